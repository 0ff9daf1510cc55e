"""``Checkpointer.all_steps()``, ``latest_step()`` and ``restore(state, step=N)`` on real tiers.

The RAM tier is a real tmpfs directory, the PVC tier a real directory that shards reach the way
the sidecar puts them there (:func:`tests.integration.test_client.promote`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer, RestoreError
from strata.tiers.posix import PosixTier
from tests.integration.test_client import JOB, Trainer, ckpt, promote, same_weights

pytestmark = pytest.mark.integration


def test_steps_per_tier_are_committed_steps_only(shm_dir: Path, tmp_path: Path) -> None:
    t = Trainer()
    pvc = PosixTier(tmp_path / "pvc")
    with ckpt(shm_dir, tmp_path, keep=8) as c:
        assert c.all_steps() == [] and c.latest_step() is None
        for s in range(5):
            t.train(s)
            assert c.save(s, t.state)
        c.wait()
        promote(c, 1, pvc)
        promote(c, 3, pvc)
        # A step with data but no manifest (an interrupted promotion) is not listed.
        partial = tmp_path / "pvc" / JOB / "steps" / f"{4:012d}"
        partial.mkdir(parents=True)
        (partial / "rank-00000.data").write_bytes(b"x" * 64)
        assert c.all_steps("ram") == [0, 1, 2, 3, 4]
        assert c.all_steps("pvc") == [1, 3]
        assert c.latest_step("pvc") == 3
        assert c.all_steps() == [0, 1, 2, 3, 4] and c.latest_step() == 4
        with pytest.raises(ValueError, match="'gcs' is not configured; configured tiers: ram, pvc"):
            c.all_steps("gcs")


def test_restore_a_chosen_step_loads_its_bytes_and_training_continues_from_it(
    shm_dir: Path, tmp_path: Path
) -> None:
    t = Trainer()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with ckpt(shm_dir, keep=8) as c:
        for s in range(5):
            t.train(s)
            assert c.save(s, t.state)
            saved[s] = t.weights()
        c.wait()

    t2 = Trainer(seed=1)
    with ckpt(shm_dir, keep=8) as c2:
        res = c2.restore(t2.state, step=2)
        assert res.step == 2 and res.next_step == 3 and res.tier == "ram"
        assert same_weights(t2.weights(), saved[2]) and t2.state["step"] == 2
        # Training goes on from step 2: the new step 3 replaces the old incarnation's 3, 4.
        t2.train(3)
        assert same_weights(t2.weights(), saved[3])  # continues bit-identically from step 2
        with torch.no_grad():  # ... and now diverges: another run from step 2
            next(t2.model.parameters()).add_(1.0)
        assert c2.save(3, t2.state)
        new3 = t2.weights()
        assert not same_weights(new3, saved[3])
        c2.wait()

    t3 = Trainer(seed=2)
    with ckpt(shm_dir, keep=8) as c3:
        # Steps 3 and 4 of the first run are above the resume point of the run that replaced
        # them: never restorable again (incarnations); the newest is the new step 3.
        assert c3.latest_step() == 3
        res = c3.restore(t3.state)
        assert res.step == 3 and same_weights(t3.weights(), new3)


def test_restore_of_a_step_that_is_not_restorable_raises_and_never_falls_back(
    shm_dir: Path,
) -> None:
    t = Trainer()
    with ckpt(shm_dir, keep=8, allow_fresh_start=True) as c:
        for s in range(3):
            t.train(s)
            assert c.save(s, t.state)
        c.wait()
    t2 = Trainer(seed=1)
    before = t2.weights()
    with ckpt(shm_dir, keep=8, allow_fresh_start=True) as c2:
        with pytest.raises(RestoreError, match=r"step 7 of job 'ns.train' is not restorable"):
            c2.restore(t2.state, step=7)
        # Neither another step nor a fresh start was taken: the live state is untouched.
        assert same_weights(t2.weights(), before)
        with pytest.raises(ValueError, match="non-negative int"):
            c2.restore(t2.state, step=-1)
        with pytest.raises(ValueError, match="non-negative int"):
            c2.restore(t2.state, step=True)


def test_steps_without_any_checkpoint_and_a_fresh_directory(shm_dir: Path) -> None:
    with Checkpointer(job_id=JOB, ram_dir=shm_dir / "none", rank=0, world_size=1) as c:
        assert c.all_steps() == [] and c.all_steps("ram") == [] and c.latest_step("ram") is None
