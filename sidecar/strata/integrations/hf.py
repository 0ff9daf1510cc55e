"""Hugging Face ``transformers.Trainer``: a ``TrainerCallback`` saving to Strata, and the resume.

::

    import strata
    from strata.integrations.hf import StrataCallback, resume_checkpoint

    ckpt = strata.Checkpointer()                    # configured as in Kubernetes (or keywords)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[StrataCallback(ckpt, every_steps=50)])
    trainer.train(resume_from_checkpoint=resume_checkpoint(ckpt, args.output_dir))

Saving: at the end of every ``every_steps``-th optimizer step (``on_step_end``: after the
optimizer, the scheduler and ``global_step += 1``; where the Trainer itself would save),
:class:`StrataCallback` snapshots what a Trainer checkpoint holds -- model weights, optimizer
and scheduler states, the RNG states (Python, numpy, torch CPU and CUDA) and the
``TrainerState`` -- into a RAM slot as Strata step ``state.global_step``; the save blocks only
for that copy and the sidecar promotes it RAM -> PVC -> GCS. The Trainer's own checkpoints can
stay on at a slow cadence (``save_steps``) or be switched off (``save_strategy="no"``).

Resume path: :func:`resume_checkpoint` restores the newest restorable step (nearest tier,
verified) and writes it as a Trainer checkpoint directory ``<output_dir>/checkpoint-<step>``
(``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``), so that ``trainer.train(resume_from_checkpoint=...)`` resumes exactly
as from the Trainer's own checkpoint: weights, optimizer, scheduler, RNG, epoch and the batches
of the current epoch already seen. It returns None when there is nothing to resume, which
``train()`` takes as a fresh start.

Scope: single-process training (one Strata rank; ``world_size`` 1). Under ``torchrun``
with several processes each rank would save its replica: not covered here. Models the codec
cannot store without pickle (a value that is not a tensor, number, string or container in a
state dict) fail the save as the Checkpointer's failure policy says (logged, training goes on).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from strata.client.checkpointer import Checkpointer

log = logging.getLogger("strata.integrations.hf")

#: The Trainer's file names in a checkpoint directory (transformers.trainer).
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG = "rng_state.pth"
TRAINER_STATE = "trainer_state.json"


def rng_states() -> dict[str, Any]:
    """The RNG states a Trainer checkpoint holds (``Trainer._save_rng_state``, one process)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.random.get_rng_state()
    return states


class StrataCallback(TrainerCallback):
    """Save the Trainer's state to Strata every ``every_steps`` optimizer steps (module doc).

    ``checkpointer``: where to save; ``every_steps``: the cadence in optimizer steps (None:
    the Checkpointer's ``ram.every``, :meth:`strata.Checkpointer.should_save`). A failed save
    is logged and recorded by the Checkpointer and training goes on. ``on_train_end`` waits for
    the last checksum pass, so the sidecar can promote the last step.
    """

    def __init__(self, checkpointer: Checkpointer, every_steps: int | None = None) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be >= 1 (or None), got {every_steps}")
        self.checkpointer = checkpointer
        self.every_steps = every_steps

    def _due(self, step: int) -> bool:
        if self.every_steps is not None:
            return step % self.every_steps == 0
        return self.checkpointer.should_save(step)

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        step = state.global_step
        if not self._due(step):
            return
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            log.error("strata: step %d not saved: the Trainer passed no model/optimizer", step)
            return
        scheduler = kwargs.get("lr_scheduler")
        snapshot: dict[str, Any] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "rng": rng_states(),
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
        }
        self.checkpointer.save(step, snapshot)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.checkpointer.wait()


def resume_checkpoint(
    checkpointer: Checkpointer, output_dir: str | os.PathLike[str], step: int | None = None
) -> str | None:
    """Restore the newest step (or ``step``) from Strata and write it as the Trainer checkpoint
    directory ``<output_dir>/checkpoint-<step>``; return its path, or None when nothing is
    restorable (a fresh start: ``train(resume_from_checkpoint=None)``).

    Raises :class:`strata.errors.RestoreError` when ``step`` is given and not restorable, or
    when nothing is restorable and the configuration does not allow a fresh start (the
    Checkpointer's ``allow_fresh_start``); ValueError for a step that holds no Trainer state
    (saved by something else than :class:`StrataCallback`).
    """
    state: dict[str, Any] = {}
    res = checkpointer.restore(state, step=step)
    if res.step is None:
        return None
    missing = {"model", "optimizer", "rng", "trainer_state"} - state.keys()
    if missing:
        raise ValueError(
            f"step {res.step} of job {checkpointer.job_id!r} holds no Trainer state (missing "
            f"{sorted(missing)}): it was not saved by StrataCallback"
        )
    from safetensors.torch import save_file

    out = Path(os.fspath(output_dir)) / f"checkpoint-{res.step}"
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors sharing storage (tied weights): one copy each; the Trainer
    # loads them with strict=False and the model ties them again.
    weights = {k: v.detach().contiguous().clone() for k, v in state["model"].items()}
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    torch.save(state["optimizer"], out / OPTIMIZER)
    if state.get("scheduler") is not None:
        torch.save(state["scheduler"], out / SCHEDULER)
    torch.save(state["rng"], out / RNG)
    (out / TRAINER_STATE).write_text(
        json.dumps(json.loads(state["trainer_state"]), indent=2, sort_keys=True) + "\n"
    )
    log.warning(
        "strata: step %d of job %s written as Trainer checkpoint %s (from the %s tier)",
        res.step,
        checkpointer.job_id,
        out,
        res.tier,
    )
    return str(out)
