"""StrataCallback with the real transformers.Trainer: a SIGKILLed run resumes mid-epoch through
``resume_checkpoint`` + ``train(resume_from_checkpoint=...)`` and ends bit-identical to an
uninterrupted run (weights, optimizer, scheduler, RNG of dropout and of the shuffled sampler)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer, RestoreError
from strata.integrations.hf import resume_checkpoint
from tests.fixtures.resume import assert_same_weights, run, run_and_kill

pytestmark = pytest.mark.integration
SCRIPT = str(Path(__file__).with_name("hf_trainer.py"))


def test_sigkilled_trainer_resumes_mid_epoch_bit_identically(shm_dir: Path, tmp_path: Path) -> None:
    ref, out = tmp_path / "ref.pt", tmp_path / "out.pt"
    first = run([SCRIPT, "--ram", str(shm_dir / "ram-ref"), "--output-dir",
                 str(tmp_path / "ref"), "--out", str(ref)])  # fmt: skip
    assert "resume from None" in first.stdout and "global_step 20" in first.stdout
    args = ["--ram", str(shm_dir / "ram"), "--output-dir", str(tmp_path / "run")]
    # Saved at 4, 8, 12 (mid-epoch: 8 steps an epoch); killed at step 14.
    run_and_kill([SCRIPT, *args, "--out", str(out), "--pause-at", "14"], tmp_path / "progress")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    done = run([SCRIPT, *args, "--out", str(out)])
    assert f"resume from {tmp_path / 'run' / 'checkpoint-12'}" in done.stdout
    assert "global_step 20" in done.stdout
    files = sorted(p.name for p in (tmp_path / "run" / "checkpoint-12").iterdir())
    assert files == [
        "model.safetensors",
        "optimizer.pt",
        "rng_state.pth",
        "scheduler.pt",
        "trainer_state.json",
    ]
    assert_same_weights(ref, out)


def test_resume_checkpoint_refuses_a_step_without_trainer_state(
    shm_dir: Path, tmp_path: Path
) -> None:
    with Checkpointer(job_id="ns.hf", ram_dir=shm_dir / "ram", rank=0, world_size=1) as c:
        assert c.save(3, {"model": {"w": torch.ones(2)}})
        c.wait()
        with pytest.raises(ValueError, match="not saved by StrataCallback"):
            resume_checkpoint(c, tmp_path)
        with pytest.raises(RestoreError, match=r"step 9 of job 'ns\.hf' is not restorable"):
            resume_checkpoint(c, tmp_path, step=9)
