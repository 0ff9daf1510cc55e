"""Incremental durable copies with several ranks (issue 18): two real trainer processes on the
gloo backend, each on its own "node" (its own RAM directory and promotion engine), share one PVC
directory. Each rank's copies reference only its own base, the step is complete in the PVC only
when both ranks' shards are, and a fresh pair of processes restores every rank bit-identically
from the PVC alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from strata.tiers.posix import PosixTier
from tests.fixtures.gloo import run_ranks

pytestmark = pytest.mark.integration
JOB = "ns.lora-ranks"
WORLD = 2

_WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from strata import Checkpointer
from strata.config import StrataConfig
from strata.sidecar.promotion import PromotionEngine
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier

phase, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
ram_dir = os.path.join(root, phase, f"node-{rank}")
pvc_dir = os.path.join(root, "pvc")
cfg = StrataConfig.parse({
    "job_id": "ns.lora-ranks",
    "ram": {"path": ram_dir, "every": {"steps": 10}, "keep": 1},
    "pvc": {"path": pvc_dir, "every": {"steps": 10}, "keep": 2},
    "writer_id": f"pod-{rank}",
    "gc_grace_seconds": 0,
    "restore": {"allow_fresh_start": phase == "train"},
})
torch.manual_seed(rank)  # each rank holds different bytes
base = torch.nn.ModuleList([torch.nn.Linear(1024, 1024, bias=False) for _ in range(3)])
base.requires_grad_(False)
adapters = torch.nn.ModuleList(
    [torch.nn.Linear(1024, 8, bias=False), torch.nn.Linear(8, 1024, bias=False)]
)
opt = torch.optim.AdamW(adapters.parameters(), lr=1e-2)
state = {"base": base, "adapters": adapters, "optim": opt, "step": 0}

def weights():
    out = {f"base.{k}": v.clone() for k, v in base.state_dict().items()}
    out.update({f"ad.{k}": v.clone() for k, v in adapters.state_dict().items()})
    return out

with Checkpointer(cfg) as c:
    assert (c.rank, c.world_size) == (rank, 2)
    if phase == "train":
        c.restore(state)  # fresh start: agrees on the incarnation of every rank
        engine = PromotionEngine(cfg, RamTier(ram_dir, keep=1), {"pvc": PosixTier(pvc_dir)},
                                 local_ranks=[rank])
        for step in (10, 20, 30):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x = torch.randn(2, 1024, generator=g)
            loss = (base[0](x) + adapters[1](adapters[0](x))).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            state["step"] = step
            assert c.save(step, state), c.last_error
            c.wait()
            dist.barrier()  # both shards in RAM before either engine promotes
            engine.promote_once()
            dist.barrier()
            engine.promote_once()  # the rank that promoted first now sees the step complete
        torch.save(weights(), os.path.join(out, f"expected-{rank}.pt"))
    else:
        with torch.no_grad():
            for p in [*base.parameters(), *adapters.parameters()]:
                p.zero_()
        res = c.restore(state)
        torch.save(weights(), os.path.join(out, f"restored-{rank}.pt"))
        with open(os.path.join(out, f"restore-{rank}.json"), "w") as f:
            json.dump({"step": res.step, "tiers": {str(k): v for k, v in res.tiers.items()}}, f)
dist.barrier()
dist.destroy_process_group()
"""


def _run(phase: str, root: Path, out: Path) -> None:
    run_ranks(_WORKER, [phase, str(root), str(out)], WORLD)


def test_two_ranks_store_incremental_copies_and_restore_each_rank_from_the_pvc_alone(
    shm_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _run("train", shm_dir, out)
    pvc = PosixTier(shm_dir / "pvc")
    assert pvc.complete_steps(JOB) == [10, 20, 30]
    for rank in range(WORLD):
        base = pvc.get_manifest(JOB, 10, rank)
        assert base.refs is None
        for step in (20, 30):
            m = pvc.get_manifest(JOB, step, rank)
            assert m.refs is not None and m.refs.base_step == 10, (step, rank)
            assert m.data_nbytes < base.data_nbytes / 2  # only the changed chunks are stored
            assert m.incarnation == base.incarnation
    assert pvc.get_manifest(JOB, 30, 0).crc32c != pvc.get_manifest(JOB, 30, 1).crc32c

    _run("restore", shm_dir, out)  # fresh RAM directories: only the PVC holds the steps
    for rank in range(WORLD):
        result = json.loads((out / f"restore-{rank}.json").read_text())
        assert result == {"step": 30, "tiers": {"0": "pvc", "1": "pvc"}}, result
        want = torch.load(out / f"expected-{rank}.pt")
        got = torch.load(out / f"restored-{rank}.pt")
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), f"rank {rank} differs"
