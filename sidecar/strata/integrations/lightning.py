"""Lightning: a ``CheckpointIO`` plugin that stores Lightning's checkpoints in Strata's tiers.

::

    import lightning.pytorch as pl
    from strata.integrations.lightning import StrataCheckpointIO

    trainer = pl.Trainer(
        plugins=[StrataCheckpointIO()],                      # Checkpointer settings as keywords
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath="ckpt", every_n_train_steps=50,
                                                save_last=True, save_top_k=-1)],
    )
    trainer.fit(model, ckpt_path="last")                     # resume: Lightning's own way

Lightning decides *when* to save (``ModelCheckpoint``) and *what* (the checkpoint dict: weights,
optimizer and scheduler states, loop progress, callbacks' states, hyper-parameters); this
plugin decides *where*: :meth:`StrataCheckpointIO.save_checkpoint` snapshots the dict into a RAM
slot as Strata step ``checkpoint["global_step"]`` (blocking only for the copy; the sidecar
promotes it RAM -> PVC -> GCS) and then writes a small JSON *pointer* at ``path`` (the job and
the step), so that Lightning's file logic (``ckpt_path="last"``, top-k bookkeeping, ``last.ckpt``)
works unchanged. :meth:`~StrataCheckpointIO.load_checkpoint` reads the step from the pointer
(or from ``step=<N>`` in the file name when the pointer is gone, e.g. on a new node whose
local directory is empty), restores it from the nearest tier and returns the dict.

Stored without pickle (:mod:`strata.format.codec`): tensors, numbers, strings, containers,
optimizer state. A failed save follows the Checkpointer's failure policy: logged at ERROR and
recorded (``checkpointer.last_error``), training goes on, the previous step is untouched and no
pointer is written, so ``ckpt_path="last"`` still finds the newest committed step. A value the
codec cannot store (an arbitrary object in ``hyper_parameters``) is such a failure, its message
naming the path: convert it in ``on_save_checkpoint``. ``raise_on_error=True`` raises instead.

:meth:`~StrataCheckpointIO.remove_checkpoint` removes the pointer only: the step's data belongs
to Strata's retention (``keep`` per tier), which never deletes the newest complete step.

Scope: single-process training and strategies whose checkpoint is one dict written by global
rank zero through ``CheckpointIO`` (Lightning calls this plugin on rank zero only), stored as a
one-rank Strata job. Sharded strategies (FSDP, DeepSpeed) save through their own distributed
writers; use :mod:`strata.dcp` there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO

from strata.client.checkpointer import Checkpointer
from strata.errors import RestoreError

POINTER_FORMAT = "strata-checkpoint-pointer/1"
"""The ``format`` of the JSON pointer file written at each checkpoint path."""

_STEP_IN_NAME = re.compile(r"step=(\d+)")


class StrataCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` over a :class:`strata.Checkpointer` (see the module doc).

    ``checkpointer``: an existing one; otherwise one is built on first use from ``settings``
    (the Checkpointer's keywords: ``job_id``, ``ram_dir``, ``pvc_dir``, ``config``, ...; the
    environment by default, as injected in Kubernetes), as rank 0 of a one-rank job, since
    Lightning hands this plugin the whole checkpoint on global rank zero.
    """

    def __init__(self, checkpointer: Checkpointer | None = None, **settings: Any) -> None:
        self._checkpointer = checkpointer
        self._settings = settings
        self._owned = checkpointer is None

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer (built on first use)."""
        if self._checkpointer is None:
            settings = {"rank": 0, "world_size": 1, **self._settings}
            self._checkpointer = Checkpointer(**settings)
        return self._checkpointer

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as Strata step ``checkpoint["global_step"]``, then write the
        pointer file at ``path``. A step that could not be committed in the RAM tier writes no
        pointer (see the module docstring). Raises ValueError for a checkpoint without
        ``global_step`` or with ``storage_options``."""
        if storage_options is not None:
            raise ValueError(
                "StrataCheckpointIO takes no storage_options: the tiers are the Checkpointer's"
            )
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"a Lightning checkpoint for Strata needs a non-negative int 'global_step', got "
                f"{step!r}"
            )
        ckpt = self.checkpointer
        if not ckpt.save(step, checkpoint):
            return  # logged and recorded by the Checkpointer; Lightning keeps training
        ckpt.wait()  # the checksum pass: the sidecar promotes checksummed shards only
        target = Path(os.fspath(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(
            json.dumps({"format": POINTER_FORMAT, "job_id": ckpt.job_id, "step": step}) + "\n"
        )
        os.replace(tmp, target)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict of the step ``path`` points to, restored from the nearest tier
        (tensors on the CPU, or moved with ``map_location`` when it is a device or a string).
        Raises :class:`strata.errors.RestoreError` when the step cannot be restored, and
        ValueError when ``path`` names no step (no pointer, no ``step=<N>`` in its name)."""
        step = pointed_step(path, self.checkpointer.job_id)
        state: dict[str, Any] = {}
        res = self.checkpointer.restore(state, step=step)
        if res.step != step:
            raise RestoreError(f"step {step} was not restored (got {res.step})")
        if isinstance(map_location, (str, torch.device)):
            state = _to_device(state, torch.device(map_location))
        return state

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the pointer file (the data is left to Strata's retention)."""
        Path(os.fspath(path)).unlink(missing_ok=True)

    def teardown(self) -> None:
        """Close the Checkpointer this plugin built (waits for background checksums)."""
        if self._owned and self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


def pointed_step(path: _PATH, job_id: str | None = None) -> int:
    """The Strata step a Lightning checkpoint path names: the pointer file's ``step``, else
    ``step=<N>`` in the file name (Lightning's default ``epoch={epoch}-step={step}.ckpt``).
    Raises ValueError for a pointer of another job or a path that names no step."""
    p = Path(os.fspath(path))
    if p.is_file():
        try:
            doc = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT:
            if job_id is not None and doc.get("job_id") != job_id:
                raise ValueError(
                    f"{p} points to job {doc.get('job_id')!r}, not {job_id!r}: configure the "
                    "same job id (STRATA_JOB_ID or job_id=) to resume it"
                )
            return int(doc["step"])
        if doc is None:
            raise ValueError(
                f"{p} is not a Strata checkpoint pointer (a torch.save file?): load it without "
                "StrataCheckpointIO"
            )
    m = _STEP_IN_NAME.search(p.name)
    if m is None:
        raise ValueError(f"{p} names no Strata step: no pointer file there and no step=<N> in it")
    return int(m.group(1))


def _to_device(node: Any, device: torch.device) -> Any:
    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, dict):
        return type(node)((k, _to_device(v, device)) for k, v in node.items())
    if isinstance(node, list):
        return [_to_device(v, device) for v in node]
    if isinstance(node, tuple):
        return tuple(_to_device(v, device) for v in node)
    return node
