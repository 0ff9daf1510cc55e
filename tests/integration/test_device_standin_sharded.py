"""Sharded state on stand-in devices (:class:`strata.client.device.StandInDevice`) with real
gloo ranks: a DTensor restore copies host-to-device from the registered RAM slot, and the
replica exchange carries device tensors when the group carries only those (NCCL)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.gloo import run_ranks

pytestmark = pytest.mark.integration

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from strata.client import Checkpointer, device

ram_root, out, nccl = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
dev = device.StandInDevice(devices=1, hold=True, nccl=nccl)
device.install(dev)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))

def values(fill=None):
    g = torch.Generator().manual_seed(7)
    a, b, r = torch.randn(8 * world, 5, generator=g), torch.randn(6, generator=g), torch.randn(9, generator=g)
    if fill is not None:
        a, b, r = (torch.full_like(t, fill) for t in (a, b, r))
    return a, b, r

def state(fill=None):
    a, b, r = values(fill)
    mine = a.chunk(world)[rank]
    return {
        "a": DTensor.from_local(dev.tensor(mine), mesh, [Shard(0)], run_check=False),
        "b": DTensor.from_local(dev.tensor(b), mesh, [Replicate()], run_check=False),
        "ddp": dev.tensor(r),   # a device tensor declared replicated
        "host": r.clone(),      # a host tensor declared replicated
    }

kw = dict(job_id="ns.standin-sharded", ram_dir=os.path.join(ram_root, f"node-{rank}"), raise_on_error=True)
with Checkpointer(**kw) as c:
    s = state()
    assert c.save(3, s, replicated={"ddp", "host"}), c.last_error
    c.wait()
    assert c.save(4, s, replicated={"ddp", "host"}), c.last_error  # into registered slots
    c.wait()
    live = state(fill=0.0)
    for k in ("a", "b"):
        assert dev.index_of(live[k].to_local()) == 0
    before_h2d, before_pinned = sum(1 for _, k in dev.copies if k == "h2d"), dev.pinned_copies
    res = c.restore(live)
    a, b, r = values()
    result = {
        "step": res.step,
        "a": bool(torch.equal(live["a"].full_tensor(), a)),
        "b": bool(torch.equal(live["b"].to_local(), b)),
        "ddp": bool(torch.equal(live["ddp"], r)),
        "host": bool(torch.equal(live["host"], r)),
        "ddp_on_device": dev.index_of(live["ddp"]) == 0,
        "h2d": sum(1 for _, k in dev.copies if k == "h2d") - before_h2d,
        "pinned": dev.pinned_copies - before_pinned,
    }
dist.barrier()
dist.destroy_process_group()
dev.close()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def _run(world: int, shm_dir: Path, out: Path, nccl: bool) -> list[dict[str, object]]:
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(WORKER, [str(shm_dir), str(out), "1" if nccl else "0"], world, timeout=300)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def test_a_dtensor_restore_copies_host_to_device_from_the_registered_slot(
    shm_dir: Path, tmp_path: Path
) -> None:
    (r,) = _run(1, shm_dir, tmp_path / "o", nccl=False)
    assert r["step"] == 4 and r["a"] and r["b"] and r["ddp"] and r["host"], r
    # a, b (DTensor locals) and ddp: host-to-device, each from the page-locked slot
    assert r["h2d"] == 3 and r["pinned"] == 3, r


@pytest.mark.parametrize("nccl", [False, True], ids=["gloo", "nccl-only"])
def test_replicas_travel_where_the_groups_backend_carries_them(
    shm_dir: Path, tmp_path: Path, nccl: bool
) -> None:
    got = _run(2, shm_dir, tmp_path / "o", nccl=nccl)
    for r in got:
        assert r["step"] == 4, r
        assert r["a"] and r["b"] and r["ddp"] and r["host"] and r["ddp_on_device"], r
