"""A resharding restore onto stand-in device tensors (:class:`strata.client.device.StandInDevice`,
``hold=True``: stream work runs only when something waits for it), with real gloo ranks.

The CUDA branch of a resharding restore: the state lives on the device. Saving copies it
device-to-host through the device seam; with ``hold=True`` a copy that nobody waits for before
the commit leaves zeros in the saved bytes. Restoring at another world size fills each live
device tensor in place from host bytes (the node's RAM slot or the PVC), each piece through the
seam's side stream (the stand-in counts those copies: a plain ``copy_`` into device memory would
not be counted), so these tests check the saved bytes, the in-place fill, the phases on device
tensors and the host-to-device path of every piece. ``c`` is sharded along its columns, so a
piece lands in a strided region of the live shard (through a contiguous landing buffer on the
device).

- 2 ranks of one pod save into the node's RAM; 1 rank restores onto the device (RAM source);
- 4 ranks save, their shards reach the PVC; 2 ranks restore onto the device (PVC source).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gloo import run_ranks
from tests.integration.test_sharded import promote

pytestmark = pytest.mark.integration
JOB = "ns.standin-reshard"

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from strata.client import Checkpointer, device

mode, ram_root, pvc, out, step, one_node = sys.argv[1:7]
step = int(step)
dev = device.StandInDevice(devices=1, hold=True)
device.install(dev)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))

def values(s, fill=None):
    g = torch.Generator().manual_seed(100 + s)
    # 24 rows: divisible by 1, 2, 4 and 8 ranks, so every world size shards it evenly
    t = {"a": torch.randn(24, 5, generator=g), "b": torch.randn(6, generator=g),
         "ddp": torch.randn(9, generator=g),
         # sharded along columns: a restored piece is a strided region of the local shard
         "c": torch.randn(5, 24, generator=g)}
    if fill is not None:
        t = {k: torch.full_like(v, fill) for k, v in t.items()}
    return t

def state(s, fill=None):
    v = values(s, fill)
    mine = v["a"].chunk(world)[rank]
    cols = v["c"].chunk(world, dim=1)[rank].contiguous()
    return {
        "a": DTensor.from_local(dev.tensor(mine), mesh, [Shard(0)], run_check=False),
        "c": DTensor.from_local(dev.tensor(cols), mesh, [Shard(1)], run_check=False),
        "b": DTensor.from_local(dev.tensor(v["b"]), mesh, [Replicate()], run_check=False),
        "ddp": dev.tensor(v["ddp"]),  # a device tensor declared replicated
        "step": s,
    }

node = "node" if one_node == "1" else f"node-{rank}"
kw = dict(job_id="ns.standin-reshard", ram_dir=os.path.join(ram_root, node),
          pvc_dir=pvc or None, allow_fresh_start=False, raise_on_error=True)
result = {"rank": rank}
with Checkpointer(**kw) as c:
    if mode == "save":
        assert c.save(step, state(step), replicated={"ddp"}), c.last_error
        c.wait()
    else:
        live = state(0, fill=0.0)
        before = len(dev.copies)
        res = c.restore(live)
        h2d = sum(1 for _, kind in dev.copies[before:] if kind == "h2d")
        v = values(res.step)
        result.update(
            step=res.step,
            resharded=res.resharded,
            saved_world_size=res.saved_world_size,
            tiers={str(k): t for k, t in res.tiers.items()},
            skipped=res.skipped,
            equal={
                "a": bool(torch.equal(live["a"].full_tensor(), v["a"])),
                "c": bool(torch.equal(live["c"].full_tensor(), v["c"])),
                "b": bool(torch.equal(live["b"].to_local(), v["b"])),
                "ddp": bool(torch.equal(live["ddp"], v["ddp"])),
            },
            on_device={k: dev.index_of(t) == 0 for k, t in
                       (("a", live["a"].to_local()), ("c", live["c"].to_local()),
                        ("b", live["b"].to_local()),
                        ("ddp", live["ddp"]))},
            step_value=live["step"],
            h2d=h2d,
        )
dist.barrier()
dist.destroy_process_group()
dev.close()
with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def _run(
    mode: str, world: int, step: int, ram_root: Path, out: Path, pvc: Path | None, one_node: bool
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    args = [mode, str(ram_root), str(pvc or ""), str(out), str(step), "1" if one_node else "0"]
    run_ranks(WORKER, args, world, timeout=600)
    return [json.loads((out / f"{mode}-rank-{r}.json").read_text()) for r in range(world)]


def _assert_resharded_onto_the_device(got: list[dict[str, Any]], step: int, saved: int) -> None:
    for r in got:
        assert r["step"] == step and r["step_value"] == step, r
        assert r["resharded"] is True and r["saved_world_size"] == saved, r
        assert r["tiers"] == {str(r["rank"]): "reshard"}, r
        # every byte in place: the save waited for its device-to-host copies, and the pieces
        # of each rank's new slice came from the right saved shards
        assert all(r["equal"].values()), r
        # filled in place: the live device tensors stay the device's
        assert all(r["on_device"].values()), r
        # and through the device seam's side stream, each piece (``a``: this rank's rows come
        # from two saved shards; ``b`` and ``ddp``: one each), not a plain copy into device memory
        assert r["h2d"] >= 4, r


def test_a_resharding_restore_from_the_nodes_ram_lands_on_the_device_2_to_1(
    shm_dir: Path, tmp_path: Path
) -> None:
    _run("save", 2, 7, shm_dir, tmp_path / "s", None, one_node=True)
    got = _run("restore", 1, 0, shm_dir, tmp_path / "r", None, one_node=True)
    _assert_resharded_onto_the_device(got, 7, 2)
    assert any("read from ram" in n for n in got[0]["skipped"]), got[0]["skipped"]


def test_a_resharding_restore_from_the_pvc_lands_on_the_device_4_to_2(
    shm_dir: Path, tmp_path: Path
) -> None:
    from strata.tiers.posix import PosixTier

    pvc = tmp_path / "pvc"
    _run("save", 4, 9, shm_dir / "old", tmp_path / "s", pvc, one_node=False)
    promote(shm_dir / "old", 4, 9, PosixTier(pvc), job=JOB)
    # new nodes: their RAM is empty; the PVC holds every shard of step 9
    got = _run("restore", 2, 0, shm_dir / "new", tmp_path / "r", pvc, one_node=False)
    _assert_resharded_onto_the_device(got, 9, 4)
    for r in got:
        assert any("read from pvc" in n for n in r["skipped"]), r["skipped"]
