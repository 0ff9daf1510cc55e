"""SIGKILL a real trainer process at random points while it saves (and restores) -- 50+ times.

Invariant after every kill: restore returns the newest committed step (manifest present in the
RAM tier), never older than the last step whose save() returned, and its bytes equal exactly
what was saved for that step.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer
from tests.fixtures import killable

pytestmark = pytest.mark.integration

KILL_POINTS = 60


def test_sigkill_during_save_never_loses_or_mixes_a_committed_step(
    shm_dir: Path, tmp_path: Path
) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "strata.client", "tests.fixtures.killable"])
    ram = shm_dir / "ram"
    log = tmp_path / "saved.log"
    rnd = random.Random(20261130)
    restored_steps: list[int] = []
    unverified = partial = 0
    for i in range(KILL_POINTS):
        p = ctx.Process(target=killable.trainer, args=(str(ram), str(log)), daemon=True)
        p.start()
        # Let it restore and save a few steps first on some runs; kill almost at once on others
        time.sleep(rnd.choice([0.0, 0.005, 0.02]) + rnd.random() * 0.12)
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=30)
        assert p.exitcode == -signal.SIGKILL, f"kill point {i}: trainer exited {p.exitcode}"

        with Checkpointer(
            job_id=killable.JOB, ram_dir=ram, rank=0, world_size=1, keep=1, allow_fresh_start=True
        ) as c:
            listing = c.ram.list_steps(killable.JOB)
            committed = sorted(s for s, entry in listing.items() if entry.committed_ranks)
            partial += sum(1 for entry in listing.values() if entry.partial_ranks)
            newest = committed[-1] if committed else None
            if newest is not None and not c.ram.get_manifest(killable.JOB, newest, 0).verified:
                unverified += 1
            state = killable.empty_state()
            res = c.restore(state)
            if res.step is not None:  # a shard left without checksums was checksummed by restore
                assert c.ram.get_manifest(killable.JOB, res.step, 0).verified
        last = killable.last_logged(log)
        assert res.step == newest, f"kill point {i}: restored {res.step}, newest committed {newest}"
        if last is not None:
            assert res.step is not None and res.step >= last, f"kill point {i}: lost step {last}"
        if res.step is not None:
            expected = killable.state_for(res.step)
            assert torch.equal(state["model"]["w"], expected["model"]["w"])
            assert torch.equal(state["model"]["w_t"], expected["model"]["w"].t())
            assert state["model"]["w_t"].data_ptr() == state["model"]["w"].data_ptr()
            assert torch.equal(state["model"]["b"], expected["model"]["b"])
            assert state["step"] == res.step and state["opt"] == expected["opt"]
            restored_steps.append(res.step)
    # the trainers made progress across kills (each continues from the restored step)
    assert len(restored_steps) >= KILL_POINTS // 2 and restored_steps[-1] > 5
    print(
        f"\n{KILL_POINTS} kill points; last step {restored_steps[-1]}; newest unverified at kill: "
        f"{unverified}; partial steps seen: {partial}"
    )
