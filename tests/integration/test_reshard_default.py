"""Resharding by default, from every tier that holds every shard of a step (issue 29, items 1
and 2), with real gloo processes, real tmpfs directories and fake-gcs-server.

- A state of DTensors and declared-replicated tensors only is resharded without being asked:
  4 -> 2 and 4 -> 8 ranks from the PVC, 4 -> 2 from GCS only, and from one node's RAM when it
  holds every rank's shard (2 ranks of one pod -> 1 rank, 4 -> 2); ``RestoreResult`` says so.
- A state with per-rank values (a plain RNG tensor, a per-rank tensor) is refused by default on
  every rank, before the live state is touched, with an error naming the values and the option;
  ``STRATA_RESTORE_RESHARD_PER_RANK=1`` accepts the documented rule; ``reshard=False`` skips it.
- A node's RAM holding only some ranks' shards is no source.

The worker is :data:`tests.integration.test_sharded.WORKER` (its switches: ``STRATA_TEST_*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_sharded import promote, run

pytestmark = pytest.mark.integration

DEFAULT = {"STRATA_TEST_RESHARD": ""}
"""The Checkpointer's default policy (no reshard argument)."""
GLOBAL = {**DEFAULT, "STRATA_TEST_GLOBAL": "1"}
"""... and a state without per-rank values (DTensors, a declared-replicated tensor, an int)."""
ONE_NODE = {"STRATA_TEST_ONE_NODE": "1"}


def assert_resharded(got: list[dict[str, Any]], step: int, saved: int, tier: str) -> None:
    for r in got:
        assert r["step"] == step and all(r["equal"].values()), r
        assert r["resharded"] is True and r["saved_world_size"] == saved, r
        assert r["tiers"] == {str(r["rank"]): "reshard"}
        note = f"step {step} resharded from world size {saved} to {len(got)} (read from {tier}"
        assert any(n.startswith(note) for n in r["skipped"]), r["skipped"]
        # nothing belongs to one rank: nothing is dropped, nothing is borrowed
        assert not any("per-rank values" in n for n in r["skipped"]), r["skipped"]
        # every rank took the same phases (a rank left behind would hang the others)
        assert r["phases"] == ["reshard-candidate", "inventory", "reshard-check", "reshard"]


def test_global_state_reshards_by_default_4_to_2_and_4_to_8_from_the_pvc(
    shm_dir: Path, tmp_path: Path
) -> None:
    from strata.tiers.posix import PosixTier

    pvc = tmp_path / "pvc"
    run("save", "4", 11, shm_dir, tmp_path / "o", pvc=pvc, env=GLOBAL)
    promote(shm_dir, 4, 11, PosixTier(pvc))
    # new nodes: their RAM is empty, the PVC holds every shard of step 11
    got = run("restore", "2", 0, shm_dir / "two", tmp_path / "o2", pvc=pvc, env=GLOBAL)
    assert_resharded(got, 11, 4, "pvc")
    assert [r["per_rank_source"] for r in got] == [0, 1]
    got = run("restore", "8", 0, shm_dir / "eight", tmp_path / "o8", pvc=pvc, env=GLOBAL)
    assert_resharded(got, 11, 4, "pvc")
    assert [r["per_rank_source"] for r in got] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_global_state_reshards_by_default_4_to_2_from_gcs_only(
    shm_dir: Path, tmp_path: Path, gcs_emulator: Any, gcs_bucket: str
) -> None:
    from strata.tiers.gcs import GcsTier

    run("save", "4", 21, shm_dir / "old", tmp_path / "o", env=GLOBAL)
    with GcsTier(gcs_emulator.tier_config(gcs_bucket), writer_id="test") as gcs:
        promote(shm_dir / "old", 4, 21, gcs)
    env = {"STRATA_GCS_BUCKET": gcs_bucket, "STORAGE_EMULATOR_HOST": gcs_emulator.endpoint}
    got = run("restore", "2", 0, shm_dir / "new", tmp_path / "o2", gcs_env=env, env=GLOBAL)
    assert_resharded(got, 21, 4, "gcs")


def test_one_nodes_ram_holding_every_rank_is_a_reshard_source_2_to_1_and_4_to_2(
    shm_dir: Path, tmp_path: Path
) -> None:
    """The issue's case: two gloo ranks of one pod save a DTensor step into the node's RAM; the
    pod returns with one rank and restores that step from RAM (no PVC, no GCS)."""
    one = {**GLOBAL, **ONE_NODE}
    run("save", "2", 40, shm_dir / "a", tmp_path / "o", env=one)
    got = run("restore", "1", 0, shm_dir / "a", tmp_path / "o1", env=one)
    assert_resharded(got, 40, 2, "ram")
    run("save", "4", 41, shm_dir / "b", tmp_path / "o4", env=one)
    got = run("restore", "2", 0, shm_dir / "b", tmp_path / "o2", env=one)
    assert_resharded(got, 41, 4, "ram")


def test_a_nodes_ram_holding_only_some_ranks_is_no_reshard_source(
    shm_dir: Path, tmp_path: Path
) -> None:
    # each rank on its own node: node-0's RAM holds rank 0's shard only
    run("save", "2", 50, shm_dir, tmp_path / "o", env=GLOBAL)
    got = run("restore", "1", 0, shm_dir, tmp_path / "o1", env=GLOBAL)
    assert got[0]["step"] is None, got  # a fresh start (allowed), said loudly
    assert any("step 50 was written with world size 2" in n for n in got[0]["skipped"]), got[0][
        "skipped"
    ]


def test_per_rank_values_refuse_by_default_and_the_option_accepts_the_documented_rule(
    shm_dir: Path, tmp_path: Path
) -> None:
    one = {**DEFAULT, **ONE_NODE}
    run("save", "4", 60, shm_dir, tmp_path / "o", env=one)
    refused = run("restore", "2", 0, shm_dir, tmp_path / "o1", env=one)
    for r in refused:
        assert r["refused"] is True, r
        assert r["blocking"] == ["state['per_rank']", "state['rng']"], r
        assert "reshard_per_rank=True" in r["error"] and "step 60" in r["error"], r["error"]
        assert r["untouched"] is True  # refused before anything was loaded
        assert r["phases"] == ["reshard-candidate", "inventory", "reshard-check"]
    # the explicit opt-out: the step is skipped (noted), and nothing else is restorable
    off = run(
        "restore",
        "2",
        0,
        shm_dir,
        tmp_path / "o2",
        env={**ONE_NODE, "STRATA_TEST_RESHARD": "false", "STRATA_TEST_NO_FRESH": "1"},
    )
    for r in off:
        assert r["refused"] is False and "no restorable checkpoint" in r["error"], r
        assert "only a resharding restore can load it" in r["error"]
    accepted = run(
        "restore",
        "2",
        0,
        shm_dir,
        tmp_path / "o3",
        env={**one, "STRATA_RESTORE_RESHARD_PER_RANK": "1"},
    )
    for r in accepted:
        assert r["step"] == 60 and all(r["equal"].values()), r
        assert r["resharded"] is True and r["saved_world_size"] == 4
        assert r["per_rank_source"] == r["rank"]
        assert r["per_rank"] == [float(r["rank"])] * 4  # saved rank r's values
        assert any(
            "per-rank values (state['per_rank'], state['rng']) of saved ranks 2-3 of step 60 "
            "are not restored" in n
            for n in r["skipped"]
        ), r["skipped"]


FSDP_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from strata.client import Checkpointer

mode, ram, out = sys.argv[1:4]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)

def full(sd):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
            for k, v in sorted(sd.items())}

def digest():
    msd, osd = get_state_dict(model, opt)
    return {"model": full(msd),
            "optim": {k: full(v) for k, v in sorted(osd["state"].items())}}

result = {"rank": rank}
with Checkpointer(job_id="ns.fsdp", ram_dir=ram, allow_fresh_start=True) as c:
    if mode == "save":
        for step in range(3):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            model(x[rank::world]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        # Adam's step counters are plain tensors equal on every rank: declared replicated
        assert c.save(2, {"model": msd, "optim": osd}, replicated={"optim"}), c.last_error
        c.wait()
    else:
        msd, osd = get_state_dict(model, opt)
        live = {"model": msd, "optim": osd}
        res = c.restore(live)
        set_state_dict(model, opt, model_state_dict=live["model"], optim_state_dict=live["optim"])
        result.update(step=res.step, resharded=res.resharded, saved=res.saved_world_size)
    result["digest"] = digest()
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def test_fsdp2_with_adam_reshards_by_default_2_to_1_when_the_step_counters_are_declared(
    shm_dir: Path, tmp_path: Path
) -> None:
    """FSDP2 + Adam (``get_state_dict``): DTensor parameters and moments, plain ``step``
    counters declared replicated, equal ``param_groups``: nothing belongs to one rank, so a
    1-rank job restores the 2-rank step from the node's RAM by default, the same global values."""
    from tests.integration.test_sharded import run_script

    ram = shm_dir / "node"
    saved = run_script(FSDP_WORKER, ["save", str(ram)], 2, tmp_path / "s")
    got = run_script(FSDP_WORKER, ["restore", str(ram)], 1, tmp_path / "r")
    assert got[0]["step"] == 2 and got[0]["resharded"] is True and got[0]["saved"] == 2
    assert got[0]["digest"] == saved[0]["digest"]
