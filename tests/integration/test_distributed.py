"""Several real training processes on the gloo backend agree on one step (C-07 with real dirs).

Each rank has its own RAM directory (its node's tmpfs); the PVC directory is shared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import gloo

pytestmark = pytest.mark.integration
JOB = "ns.dist"

_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from strata.client import Checkpointer

ram_root, pvc, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ram = os.path.join(ram_root, f"node-{rank}")

def state_for(step):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(64, generator=g), "step": step, "rank": rank}

with Checkpointer(job_id="ns.dist", ram_dir=ram, pvc_dir=pvc or None, allow_fresh_start=True) as c:
    assert (c.rank, c.world_size) == (rank, world)
    live = {"w": torch.zeros(64), "step": -1, "rank": -1}
    res = c.restore(live)
    ok = res.step is None or torch.equal(live["w"], state_for(res.step)["w"])
    result = {"step": res.step, "tiers": {str(k): v for k, v in res.tiers.items()}, "ok": ok,
              "loaded_rank": live["rank"], "skipped": res.skipped}
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def state_for(step: int, rank: int) -> dict[str, object]:
    """The same deterministic state the worker expects (see _WORKER.state_for)."""
    import torch

    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(64, generator=g), "step": step, "rank": rank}


def save_as_ranks(ram_root: Path, steps: list[list[int]]) -> None:
    """Write each rank's RAM tier as its trainer would (saving needs no process group)."""
    from strata.client import Checkpointer

    world = len(steps)
    for rank, rank_steps in enumerate(steps):
        with Checkpointer(
            job_id=JOB, ram_dir=ram_root / f"node-{rank}", rank=rank, world_size=world
        ) as c:
            for s in rank_steps:
                assert c.save(s, state_for(s, rank)), c.last_error


def run_ranks(
    world: int,
    ram_root: Path,
    pvc: Path | None,
    out: Path,
) -> list[dict[str, Any]]:
    """Run ``world`` restoring trainer processes (gloo on loopback); their JSON results by rank."""
    out.mkdir(parents=True, exist_ok=True)
    gloo.run_ranks(_WORKER, [str(ram_root), str(pvc or ""), str(out)], world, timeout=120)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def test_c07_ranks_agree_on_the_newest_step_every_rank_holds(shm_dir: Path, tmp_path: Path) -> None:
    """C-07: rank 0's RAM holds 95 and 100, rank 1's only 95 (no other tier has 100) -> all 95."""
    save_as_ranks(shm_dir, [[95, 100], [95]])
    results = run_ranks(2, shm_dir, None, tmp_path / "r")
    assert [r["step"] for r in results] == [95, 95]
    assert all(r["ok"] for r in results) and [r["loaded_rank"] for r in results] == [0, 1]
    assert results[0]["tiers"] == {"0": "ram", "1": "ram"}


def test_four_ranks_pvc_fills_the_gap(shm_dir: Path, tmp_path: Path) -> None:
    """Rank 3's RAM was lost (pod rescheduled); its shard of step 20 survives on the shared PVC."""
    from strata.tiers.posix import PosixTier
    from strata.tiers.ram import RamTier
    from strata.tiers.slots import SlotLease

    pvc = tmp_path / "pvc"
    save_as_ranks(shm_dir, [[10, 20]] * 4)
    ram3 = RamTier(shm_dir / "node-3")
    with SlotLease(ram3, JOB, 20, 3) as lease:
        assert lease.manifest is not None
        PosixTier(pvc).put_shard(JOB, 20, 3, lease.path, lease.manifest)
    import shutil

    shutil.rmtree(shm_dir / "node-3")
    results = run_ranks(4, shm_dir, pvc, tmp_path / "r")
    assert [r["step"] for r in results] == [20] * 4
    assert all(r["ok"] for r in results)
    assert results[0]["tiers"] == {"0": "ram", "1": "ram", "2": "ram", "3": "pvc"}


def test_a_rank_failing_to_stage_makes_all_ranks_replan(shm_dir: Path, tmp_path: Path) -> None:
    """Rank 1's shard of step 8 is corrupt in its only copy: every rank falls back to step 4."""
    save_as_ranks(shm_dir, [[4, 8], [4, 8]])
    from strata.tiers.ram import RamTier

    p = RamTier(shm_dir / "node-1").data_path(JOB, 8, 1)
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF
    p.write_bytes(bytes(raw))
    results = run_ranks(2, shm_dir, None, tmp_path / "r")
    assert [r["step"] for r in results] == [4, 4]
    assert all(r["ok"] for r in results)
