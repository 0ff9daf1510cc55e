"""A rank whose load fails (any error, not only a corrupt copy) never leaves the others waiting:
every rank learns of it in the next collective and every restore raises (gloo, real ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures import gloo

pytestmark = pytest.mark.integration
JOB = "ns.lockstep"

_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from strata.client import Checkpointer

ram_root, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
# Rank 1 restores into a model that does not fit its checkpoint: its load raises CodecError.
live = {"w": torch.zeros(64 if rank == 0 else 65)}
with Checkpointer(job_id="ns.lockstep", ram_dir=os.path.join(ram_root, f"node-{rank}")) as c:
    try:
        c.restore(live)
        result = {"raised": None}
    except Exception as exc:
        result = {"raised": type(exc).__name__, "message": str(exc)}
dist.barrier()  # both ranks got here: nobody waits in a gather the other left
dist.destroy_process_group()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def test_a_load_failing_on_one_rank_makes_every_rank_raise_not_hang(
    shm_dir: Path, tmp_path: Path
) -> None:
    import torch

    from strata.client import Checkpointer

    for rank in range(2):
        with Checkpointer(
            job_id=JOB, ram_dir=shm_dir / f"node-{rank}", rank=rank, world_size=2
        ) as c:
            assert c.save(5, {"w": torch.full((64,), float(rank))}), c.last_error
    out = tmp_path / "out"
    out.mkdir()
    # Before the fix rank 1 left restore() with its CodecError while rank 0 waited in the
    # all-gather of load outcomes: the run timed out.
    gloo.run_ranks(_WORKER, [str(shm_dir), str(out)], 2, timeout=120)
    r0, r1 = (json.loads((out / f"rank-{r}.json").read_text()) for r in range(2))
    assert r1["raised"] == "CodecError"
    assert r0["raised"] == "RestoreError"
    assert "step 5 could not be loaded on every rank" in r0["message"]
    assert "rank 1: CodecError" in r0["message"]


_PHASES_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from strata.client import Checkpointer

ram_root, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
with Checkpointer(
    job_id="ns.lockstep", ram_dir=os.path.join(ram_root, f"node-{rank}"), keep=2
) as c:
    res = c.restore({"w": torch.zeros(64)})
    result = {"step": res.step, "phases": list(c.restorer.phases.trace), "skipped": res.skipped}
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def test_every_rank_takes_the_same_restore_phases_in_the_same_order_when_one_rank_replans(
    shm_dir: Path, tmp_path: Path
) -> None:
    import torch

    from strata.client import Checkpointer
    from tests.fixtures.checkpoints import flip_byte

    for rank in range(2):
        with Checkpointer(
            job_id=JOB, ram_dir=shm_dir / f"node-{rank}", rank=rank, world_size=2, keep=2
        ) as c:
            for step in (5, 10):
                assert c.save(step, {"w": torch.full((64,), float(step))}), c.last_error
            c.wait()
            if rank == 1:
                flip_byte(c.ram.data_path(JOB, 10, 1))  # only rank 1's copy of step 10 is bad
    out = tmp_path / "out"
    out.mkdir()
    gloo.run_ranks(_PHASES_WORKER, [str(shm_dir), str(out)], 2, timeout=120)
    r0, r1 = (json.loads((out / f"rank-{r}.json").read_text()) for r in range(2))
    assert r0["step"] == r1["step"] == 5  # step 10 failed on rank 1: both planned again
    assert any("quarantined" in n for n in r1["skipped"])
    # Rank 0 loaded step 10 and rank 1 did not, yet both took the same phases.
    assert r0["phases"] == r1["phases"]
    # Resharding is on by default: every restore first gathers every rank's reshard sources.
    assert r0["phases"] == [
        "reshard-candidate",
        "inventory",
        "stage",
        "load",
        "inventory",
        "stage",
        "load",
        "replicas",
        "sharded",
    ]
