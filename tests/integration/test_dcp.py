"""strata.dcp StorageWriter/StorageReader with torch.distributed.checkpoint (issue 13): FSDP2 on
CPU with gloo, saved by 2 ranks through Strata's RAM tier (promoted to the PVC as the sidecar
would), loaded by 4 ranks; ``dcp.load`` of the Strata checkpoint equals ``dcp.load`` of a plain
FileSystemWriter checkpoint of the same state. And a single-process round trip from RAM only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.checkpoints import flip_byte
from tests.integration.test_sharded import promote, run_script

pytestmark = pytest.mark.integration
JOB = "ns.sharded"

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
import strata.dcp

mode, ram_root, pvc, fsdir, out = sys.argv[1:6]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt

def flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out[prefix + k] = json.dumps(v, sort_keys=True, default=str)
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = (v.full_tensor() if isinstance(v, DTensor) else v).tolist()
        else:
            out[prefix + k] = v
    return out

kw = dict(job_id="ns.sharded", ram_dir=os.path.join(ram_root, f"node-{rank}"), pvc_dir=pvc)
if mode == "save":
    model, opt = build(0)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "epoch": 3}
    w = strata.dcp.StorageWriter(step=2, **kw)
    dcp.save(sd, storage_writer=w)
    w.close()
    dcp.save(sd, checkpoint_id=fsdir)
    result = flat(sd)
else:
    loaded = []
    for how in ("strata", "fs"):
        model, opt = build(1)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "epoch": 0}
        if how == "strata":
            r = strata.dcp.StorageReader(step=None, **kw)
            dcp.load(sd, storage_reader=r)
            r.close()
        else:
            dcp.load(sd, checkpoint_id=fsdir)
        loaded.append(flat(sd))
    result = {"equal": loaded[0] == loaded[1], "state": loaded[0]}
with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp2_dcp_save_at_two_ranks_load_at_four_equals_plain_dcp(
    shm_dir: Path, tmp_path: Path
) -> None:
    from strata.tiers.posix import PosixTier

    pvc, fsdir, out = tmp_path / "pvc", tmp_path / "fs", tmp_path / "o"
    saved = run_script(WORKER, ["save", str(shm_dir), str(pvc), str(fsdir)], 2, out)
    promote(shm_dir, 2, 2, PosixTier(pvc))
    got = run_script(WORKER, ["load", str(shm_dir), str(pvc), str(fsdir)], 4, out)
    for r in got:
        assert r["equal"]
        assert r["state"] == saved[0]
    assert got[0]["state"]["epoch"] == 3


def test_single_process_round_trip_from_ram(tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import strata.dcp

    model = torch.nn.Linear(4, 3)
    sd = {"model": model.state_dict(), "extra": {"epoch": 3, "name": "x"}}
    w = strata.dcp.StorageWriter(step=3, job_id=JOB, ram_dir=tmp_path / "ram")
    with pytest.warns(UserWarning, match="single process"):
        dcp_save(sd, storage_writer=w)
    w.close()
    live: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
        "extra": {"epoch": 0, "name": ""},
    }
    r = strata.dcp.StorageReader(job_id=JOB, ram_dir=tmp_path / "ram")
    with pytest.warns(UserWarning, match="single process"):
        dcp_load(live, storage_reader=r)
    r.close()
    assert r.step == 3 and live["extra"] == {"epoch": 3, "name": "x"}
    for k, v in model.state_dict().items():
        assert torch.equal(live["model"][k], v)
    with pytest.raises(ValueError, match="step number"):
        strata.dcp.StorageReader(job_id=JOB, ram_dir=tmp_path / "ram").reset("/some/dir")
    assert json.dumps(r.step) == "3"


def _save_steps(ram: Path, steps: list[int]) -> dict[int, dict[str, Any]]:
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import strata.dcp

    saved = {}
    for step in steps:
        torch.manual_seed(step)
        sd = {"model": torch.nn.Linear(64, 32).state_dict(), "extra": {"epoch": step}}
        w = strata.dcp.StorageWriter(step=step, job_id=JOB, ram_dir=ram)
        with pytest.warns(UserWarning, match="single process"):
            dcp_save(sd, storage_writer=w)
        w.close()
        saved[step] = sd
    return saved


def _load_newest(**kw: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    import strata.dcp

    live: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in torch.nn.Linear(64, 32).state_dict().items()},
        "extra": {"epoch": -1},
    }
    r = strata.dcp.StorageReader(step=None, job_id=JOB, **kw)
    with pytest.warns(UserWarning, match="single process"):
        dcp_load(live, storage_reader=r)
    r.close()
    return r, live


def test_newest_step_with_a_corrupt_shard_falls_back_to_the_intact_older_step(
    tmp_path: Path,
) -> None:
    """step=None: the newest step's only shard has a flipped byte (RAM, no other copy): the
    load takes the older intact step instead of failing, and says why."""
    import torch

    from strata.tiers.ram import RamTier

    ram = tmp_path / "ram"
    saved = _save_steps(ram, [4, 5])
    path = RamTier(ram).data_path(JOB, 5, 0)
    assert path is not None
    flip_byte(path, 100)
    r, live = _load_newest(ram_dir=ram)
    assert r.step == 4 and live["extra"] == {"epoch": 4}
    for k, v in saved[4]["model"].items():
        assert torch.equal(live["model"][k], v)
    assert any("step 5" in n and "checksum" in n for n in r.notes), r.notes


def test_newest_committed_step_on_the_pvc_with_a_corrupt_shard_falls_back(tmp_path: Path) -> None:
    """Both steps promoted to the PVC with commit records; the node's RAM is gone; the newest
    step's shard on the PVC is corrupt: the older committed step is loaded."""
    import torch

    from strata.tiers.posix import PosixTier
    from strata.tiers.records import commit_if_complete
    from tests.integration.test_sharded import promote

    ram_root, pvc = tmp_path / "ram", tmp_path / "pvc"
    saved = _save_steps(ram_root / "node-0", [4, 5])
    tier = PosixTier(pvc)
    for step in (4, 5):
        promote(ram_root, 1, step, tier, job=JOB)
        assert commit_if_complete(tier, JOB, step, "test") is not None
    path = tier.data_path(JOB, 5, 0)
    assert path is not None
    flip_byte(path, 7)
    r, live = _load_newest(ram_dir=tmp_path / "empty-ram", pvc_dir=pvc)
    assert r.step == 4 and live["extra"] == {"epoch": 4}
    for k, v in saved[4]["model"].items():
        assert torch.equal(live["model"][k], v)
