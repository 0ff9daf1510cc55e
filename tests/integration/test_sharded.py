"""Sharded state (issue 13) with real gloo processes: DTensors on 1-D and 2-D CPU meshes, FSDP2,
replicated tensors written once, restore at the same and at another world size / mesh, from
RAM+PVC and from GCS only, and a rank killed mid-save.

Each rank has its own RAM directory (its node's tmpfs); the PVC directory is shared. Promotion
is done here with the tiers' own ``put_shard`` (what the sidecar does), so the tests need no
sidecar process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gloo import run_ranks

pytestmark = pytest.mark.integration
JOB = "ns.sharded"

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from strata.client import Checkpointer

mode, ram_root, pvc, gcs, out, spec, step = sys.argv[1:8]
step = int(step)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
shape = tuple(int(x) for x in spec.split("x"))
mesh = init_device_mesh("cpu", shape)
if len(shape) == 1:
    pl = {"a": [Shard(0)], "b": [Replicate()], "c": [Shard(1)], "e": [Shard(0)]}
else:
    pl = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)], "c": [Replicate(), Replicate()],
          "e": [Shard(0), Replicate()]}

def global_tensors(s):
    g = torch.Generator().manual_seed(1000 + s)
    return {"a": torch.randn(10, 6, generator=g), "b": torch.randn(7, generator=g),
            "c": torch.randn(3, 4, generator=g).to(torch.bfloat16),
            "e": torch.arange(5 * 3, dtype=torch.int64).reshape(5, 3) + s,
            "ddp": torch.randn(33, generator=g)}

GLOBAL = os.environ.get("STRATA_TEST_GLOBAL") == "1"  # no per-rank values at all

def state_for(s, fill=None):
    gt = global_tensors(s)
    if fill is not None:
        gt = {k: torch.full_like(v, fill) for k, v in gt.items()}
    model = {k: distribute_tensor(gt[k], mesh, pl[k]) for k in pl}
    if GLOBAL:
        return {"model": model, "ddp": gt["ddp"], "step": s}
    return {"model": model, "ddp": gt["ddp"], "per_rank": torch.full((4,), float(rank)),
            "rng": torch.get_rng_state(), "step": s}

# STRATA_TEST_RESHARD: "true" (reshard=True, the old opt-in), "false", "" (the default policy)
reshard = {"true": True, "false": False, "": None}[os.environ.get("STRATA_TEST_RESHARD", "true")]
node = "node" if os.environ.get("STRATA_TEST_ONE_NODE") == "1" else f"node-{rank}"
kw = dict(job_id="ns.sharded", ram_dir=os.path.join(ram_root, node),
          pvc_dir=pvc or None, allow_fresh_start=os.environ.get("STRATA_TEST_NO_FRESH") != "1",
          reshard=reshard)
if gcs:
    os.environ["STRATA_GCS_BUCKET"] = gcs
result = {"rank": rank}
with Checkpointer(**kw) as c:
    if mode == "save":
        torch.manual_seed(rank)
        state = state_for(step)
        if os.environ.get("STRATA_TEST_DIE") == str(rank):
            os._exit(3)  # killed mid-save: nothing of this rank's shard is committed
        assert c.save(step, state, replicated={"ddp"}), c.last_error
        c.wait()
        m = c.ram.get_manifest("ns.sharded", step, rank)
        result["data_nbytes"] = m.data_nbytes
        result["owned"] = {e.path: e.tensor is not None for e in m.sharded}
    else:
        from strata.errors import RestoreError
        from strata.restore.reshard import ReshardRefused

        live = state_for(0, fill=0)
        live["ddp"].zero_()
        try:
            res = c.restore(live)
        except RestoreError as exc:
            result["error"] = str(exc)
            result["refused"] = isinstance(exc, ReshardRefused)
            result["blocking"] = getattr(exc, "blocking", None)
            result["untouched"] = all(
                not live["model"][k].full_tensor().any() for k in pl
            ) and not live["ddp"].any()
            res = None
        result["phases"] = list(c.restorer.phases.trace)
        if res is not None:
            result["step"] = res.step
            result["skipped"] = res.skipped
            result["tiers"] = {str(k): v for k, v in res.tiers.items()}
            result["resharded"] = res.resharded
            result["saved_world_size"] = res.saved_world_size
            result["per_rank_source"] = res.per_rank_source
        if res is not None and res.step is not None:
            gt = global_tensors(res.step)
            result["equal"] = {
                k: bool(torch.equal(live["model"][k].full_tensor(), gt[k])) for k in pl
            }
            result["equal"]["ddp"] = bool(torch.equal(live["ddp"], gt["ddp"]))
            if not GLOBAL:
                result["per_rank"] = live["per_rank"].tolist()
            result["placements"] = {k: repr(live["model"][k].placements) for k in pl}
if "STRATA_TEST_DIE" not in os.environ:
    dist.barrier()
    dist.destroy_process_group()
with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def run(
    mode: str,
    spec: str,
    step: int,
    ram_root: Path,
    out: Path,
    pvc: Path | None = None,
    gcs_env: dict[str, str] | None = None,
    die: int | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run the sharded worker as one gloo job of prod(spec) ranks; their results by rank.
    ``env``: the worker's switches (``STRATA_TEST_RESHARD``, ``STRATA_TEST_GLOBAL``,
    ``STRATA_TEST_ONE_NODE``, ``STRATA_TEST_NO_FRESH``) and Strata's own variables."""
    world = 1
    for x in spec.split("x"):
        world *= int(x)
    bucket = (gcs_env or {}).get("STRATA_GCS_BUCKET", "")
    args = [mode, str(ram_root), str(pvc or ""), bucket, str(out), spec, str(step)]
    both = {**(gcs_env or {}), **(env or {})}
    return run_script(WORKER, args, world, out, env=both, die=die, mode=mode)


def run_script(
    script: str,
    args: list[str],
    world: int,
    out: Path,
    env: dict[str, str] | None = None,
    die: int | None = None,
    mode: str | None = None,
) -> list[dict[str, Any]]:
    """Run ``script`` as ``world`` gloo ranks on loopback (argv: ``args``, then ``out`` when
    ``mode`` is None); each writes ``<mode or args[0]>-rank-<r>.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    argv = list(args) if mode is not None else [*args, str(out)]
    name = mode or args[0]
    extra = dict(env or {})
    if die is not None:
        extra["STRATA_TEST_DIE"] = str(die)
    run_ranks(script, argv, world, env=extra, may_die=die, timeout=600)
    return [
        json.loads((out / f"{name}-rank-{r}.json").read_text())
        for r in range(world)
        if (out / f"{name}-rank-{r}.json").exists()
    ]


def promote(
    ram_root: Path, world: int, step: int, tier: Any, job: str = JOB, one_node: bool = False
) -> None:
    """Copy every rank's RAM shard of ``step`` into ``tier`` and write the step's global commit
    record there (what the sidecar's promotion does). ``one_node``: every rank's shard is in
    ``ram_root/node`` (several ranks of one pod), else in ``ram_root/node-<rank>``."""
    from strata.tiers.ram import RamTier
    from strata.tiers.records import commit_if_complete
    from strata.tiers.slots import SlotLease

    for r in range(world):
        node = ram_root / ("node" if one_node else f"node-{r}")
        with SlotLease(RamTier(node), job, step, r) as lease:
            assert lease.manifest is not None and lease.manifest.verified
            tier.put_shard(job, step, r, lease.path, lease.manifest)
    assert commit_if_complete(tier, job, step, "test-promotion") is not None


def _ram_shard(ram_root: Path, rank: int, step: int) -> tuple[Path, Any]:
    from strata.tiers.ram import RamTier

    ram = RamTier(ram_root / f"node-{rank}")
    m = ram.get_manifest(JOB, step, rank)
    path = ram.data_path(JOB, step, rank)
    assert path is not None
    return path, m


def unique_bytes() -> int:
    """Bytes of the global tensors the workers save once (model + ddp) plus the per-rank ones."""
    return 10 * 6 * 4 + 7 * 4 + 3 * 4 * 2 + 5 * 3 * 8 + 33 * 4


def test_same_world_size_restores_from_ram_with_replicas_from_their_owners(
    shm_dir: Path, tmp_path: Path
) -> None:
    saved = run("save", "4", 7, shm_dir, tmp_path / "o")
    # every replicated chunk (b, ddp; c is sharded on dim 1 of 4 columns) is written once
    for key in ("state['model']['b']", "state['ddp']"):
        assert sum(r["owned"][key] for r in saved) == 1, key
    assert all(r["owned"]["state['model']['a']"] for r in saved)
    got = run("restore", "4", 0, shm_dir, tmp_path / "o")
    for r in got:
        assert r["step"] == 7 and all(r["equal"].values()), r
        assert r["tiers"] == {"0": "ram", "1": "ram", "2": "ram", "3": "ram"}
        assert r["per_rank"] == [float(r["rank"])] * 4


def test_bytes_of_a_durable_step_are_the_unique_bytes(shm_dir: Path, tmp_path: Path) -> None:
    saved = run("save", "2x2", 3, shm_dir, tmp_path / "o")
    total = sum(r["data_nbytes"] for r in saved)
    rng = 5056
    unique = unique_bytes() + 4 * (4 * 4 + rng)
    # storages are 64-byte aligned: at most 63 bytes of padding per storage (<= 7 per rank)
    assert unique <= total <= unique + 4 * 7 * 63, (total, unique)
    got = run("restore", "2x2", 0, shm_dir, tmp_path / "o")
    assert all(r["step"] == 3 and all(r["equal"].values()) for r in got), got


def test_four_ranks_to_two_from_pvc_and_two_to_four(shm_dir: Path, tmp_path: Path) -> None:
    from strata.tiers.posix import PosixTier

    pvc = tmp_path / "pvc"
    run("save", "4", 11, shm_dir, tmp_path / "o", pvc=pvc)
    promote(shm_dir, 4, 11, PosixTier(pvc))
    got = run("restore", "2", 0, shm_dir, tmp_path / "o", pvc=pvc)
    for r in got:
        assert r["step"] == 11 and all(r["equal"].values()), r
        assert r["per_rank"] == [float(r["rank"])] * 4
        assert any("resharded from world size 4 to 2" in n for n in r["skipped"]), r["skipped"]
        assert any("of saved ranks 2-3 of step 11 are not restored" in n for n in r["skipped"])
        assert not any("not supported" in n for n in r["skipped"]), r["skipped"]
    # the 2-rank job saves step 12; a 4-rank job (FSDP 2 x TP 2 mesh) restores it
    run("save", "2", 12, shm_dir, tmp_path / "o2", pvc=pvc)
    promote(shm_dir, 2, 12, PosixTier(pvc))
    got = run("restore", "2x2", 0, shm_dir, tmp_path / "o3", pvc=pvc)
    for r in got:
        assert r["step"] == 12 and all(r["equal"].values()), r
        assert r["per_rank"] == [float(r["rank"] % 2)] * 4
    assert any("did not exist in step 12" in n for n in got[3]["skipped"])


def test_kill_one_rank_mid_save_leaves_the_step_incomplete(shm_dir: Path, tmp_path: Path) -> None:
    from strata.tiers.posix import PosixTier

    pvc = tmp_path / "pvc"
    run("save", "2", 5, shm_dir, tmp_path / "o", pvc=pvc)
    promote(shm_dir, 2, 5, PosixTier(pvc))
    # rank 1 is killed in the middle of saving step 6; rank 0's shard is committed and even
    # promoted: step 6 is complete nowhere, so every rank restores step 5
    saved = run("save", "2", 6, shm_dir, tmp_path / "o6", pvc=pvc, die=1)
    assert [r["rank"] for r in saved] == [0]
    PosixTier(pvc).put_shard(JOB, 6, 0, *_ram_shard(shm_dir, 0, 6))
    assert PosixTier(pvc).complete_steps(JOB) == [5]
    got = run("restore", "2", 0, shm_dir, tmp_path / "o4", pvc=pvc)
    assert [r["step"] for r in got] == [5, 5]
    assert all(all(r["equal"].values()) for r in got)


def test_four_ranks_to_two_from_gcs_only(
    shm_dir: Path, tmp_path: Path, gcs_emulator: Any, gcs_bucket: str
) -> None:
    """The step is only in GCS (no PVC, the new ranks' RAM is empty): resharded from GCS."""
    from strata.tiers.gcs import GcsTier

    run("save", "4", 21, shm_dir / "old", tmp_path / "o")
    with GcsTier(gcs_emulator.tier_config(gcs_bucket), writer_id="test") as gcs:
        promote(shm_dir / "old", 4, 21, gcs)
    env = {"STRATA_GCS_BUCKET": gcs_bucket, "STORAGE_EMULATOR_HOST": gcs_emulator.endpoint}
    got = run("restore", "2", 0, shm_dir / "new", tmp_path / "o2", gcs_env=env)
    for r in got:
        assert r["step"] == 21 and all(r["equal"].values()), r
        assert any("resharded from world size 4 to 2" in n for n in r["skipped"]), r["skipped"]
