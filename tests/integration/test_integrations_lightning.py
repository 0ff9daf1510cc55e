"""StrataCheckpointIO with the real Lightning Trainer: a SIGKILLed fit resumes bit-identically
with ``ckpt_path="last"``; the checkpoint dict Lightning hands the plugin round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from strata.integrations.lightning import POINTER_FORMAT, StrataCheckpointIO, pointed_step
from tests.fixtures.resume import assert_same_weights, run, run_and_kill

pytestmark = pytest.mark.integration
SCRIPT = str(Path(__file__).with_name("lightning_trainer.py"))


def test_sigkilled_fit_resumes_from_last_bit_identically(shm_dir: Path, tmp_path: Path) -> None:
    ref, out = tmp_path / "ref.pt", tmp_path / "out.pt"
    run([SCRIPT, "--ram", str(shm_dir / "ram-ref"), "--dirpath", str(tmp_path / "ref"),
         "--out", str(ref)])  # fmt: skip
    args = ["--ram", str(shm_dir / "ram"), "--dirpath", str(tmp_path / "ckpt")]
    # Epochs end at steps 4, 8, 12 (saved); killed during the 4th epoch, at step 14.
    run_and_kill([SCRIPT, *args, "--out", str(out), "--pause-at", "14"], tmp_path / "progress")
    pointers = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert pointers == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last.ckpt",
    ]
    last = json.loads((tmp_path / "ckpt" / "last.ckpt").read_text())
    assert last == {"format": POINTER_FORMAT, "job_id": "ns.lightning", "step": 12}
    done = run([SCRIPT, *args, "--out", str(out)])
    assert "global_step 20" in done.stdout
    assert "strata: restored step 12 of job ns.lightning" in done.stderr
    assert_same_weights(ref, out)


def test_load_by_name_when_the_pointer_is_gone(shm_dir: Path, tmp_path: Path) -> None:
    """A new node: the local pointer directory is empty, the step is in the name."""
    state = {"global_step": 7, "state_dict": {"w": torch.arange(6.0)}, "epoch": 1, "loops": {}}
    io = StrataCheckpointIO(job_id="ns.lightning", ram_dir=shm_dir / "ram")
    path = tmp_path / "epoch=1-step=7.ckpt"
    io.save_checkpoint(state, path)
    assert pointed_step(path, "ns.lightning") == 7
    io.remove_checkpoint(path)
    assert not path.exists()
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["w"], torch.arange(6.0))
    with pytest.raises(ValueError, match="names no Strata step"):
        io.load_checkpoint(tmp_path / "best.ckpt")
    torch.save({"x": 1}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="not a Strata checkpoint pointer"):
        io.load_checkpoint(tmp_path / "plain.ckpt")
    io.teardown()
    other = StrataCheckpointIO(job_id="ns.other", ram_dir=shm_dir / "ram2")
    io2 = StrataCheckpointIO(job_id="ns.lightning", ram_dir=shm_dir / "ram")
    io2.save_checkpoint(state, path)
    with pytest.raises(ValueError, match=r"points to job 'ns\.lightning', not 'ns\.other'"):
        other.load_checkpoint(path)
    io2.teardown()
    other.teardown()


def test_a_failed_save_writes_no_pointer_and_keeps_training(shm_dir: Path, tmp_path: Path) -> None:
    io = StrataCheckpointIO(job_id="ns.lightning", ram_dir=shm_dir / "ram")
    good = {"global_step": 3, "state_dict": {"w": torch.ones(2)}}
    io.save_checkpoint(good, tmp_path / "last.ckpt")
    bad = {"global_step": 4, "hyper_parameters": {"obj": object()}}
    io.save_checkpoint(bad, tmp_path / "last.ckpt")  # logged, not raised
    assert "state['hyper_parameters']['obj']" in (io.checkpointer.last_error or "")
    assert pointed_step(tmp_path / "last.ckpt") == 3  # still the newest committed step
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3
    with pytest.raises(ValueError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "x.ckpt")
    io.teardown()
