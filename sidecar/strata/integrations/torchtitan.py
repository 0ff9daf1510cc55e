"""torchtitan: the calls its ``CheckpointManager`` makes, over Strata's tiers.

torchtitan's ``CheckpointManager`` saves with ``dcp.save(state_dict, checkpoint_id=...)`` /
``dcp.async_save(...)`` where ``checkpoint_id`` is ``f"{checkpoint.folder}/step-{step}"``, and
resumes from the highest ``step-N`` folder holding a DCP ``.metadata`` file
(``_find_load_step``). :mod:`strata.dcp` accepts those path-style ids as they are
(:mod:`strata.dcp.ids`), so the three functions below are drop-in bodies for the manager's
``dcp_save``, ``dcp_load`` and ``_find_load_step``: the same arguments, with Strata's
``StorageWriter`` / ``StorageReader`` passed in and the step taken from the id::

    import strata
    from strata.integrations import torchtitan as strata_titan

    ckpt = strata.Checkpointer()                        # configured as in Kubernetes
    step = strata_titan.find_load_step(ckpt)            # -1: nothing to resume (torchtitan's value)
    if step >= 0:
        strata_titan.dcp_load(states, f"{folder}/step-{step}", ckpt)
    ...
    strata_titan.dcp_save(states, f"{folder}/step-{step}", ckpt)   # or async_mode="async"

``states``: torchtitan's dict of ``Stateful`` objects (``ModelWrapper``, ``OptimizersContainer``,
the dataloader, ``TrainState``), exactly what the manager hands DCP. The folder of the id names
no location: where bytes go is the Checkpointer's configuration (RAM slot, then the sidecar
promotes to the PVC and GCS), and retention is the sidecar's (``keep`` per tier), so the
manager's ``keep_latest_k`` purge has nothing to delete.

Tested with real ``torch.distributed.checkpoint`` calls made the way the manager makes them and
a SIGKILLed trainer resuming bit-identically (``tests/integration/test_integrations_torchtitan.py``);
torchtitan itself is not a test dependency (its own dependencies pin another huggingface_hub).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Literal

from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as _dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from strata.client.checkpointer import Checkpointer
from strata.dcp import StorageReader, StorageWriter, step_of_checkpoint_id
from strata.errors import RestoreError

AsyncMode = Literal["disabled", "async"]


def _step(checkpoint_id: str | os.PathLike[str]) -> int:
    step = step_of_checkpoint_id(checkpoint_id)
    if step is None:
        raise ValueError(
            f"checkpoint_id {os.fspath(checkpoint_id)!r} names no step: torchtitan's ids end in "
            "step-<N> (CheckpointManager._create_checkpoint_id)"
        )
    return step


def dcp_save(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    checkpointer: Checkpointer,
    async_mode: AsyncMode = "disabled",
    process_group: Any = None,
) -> Future[Any] | None:
    """Save ``state_dict`` as the step of ``checkpoint_id`` (``".../step-100"`` -> 100).

    ``async_mode="disabled"``: ``dcp.save``; returns None once the step is committed in the RAM
    tier (blocks for the copy and the checksum pass). ``"async"``: ``dcp.async_save`` (the
    returned future completes when it is committed; pass ``process_group``, a gloo group, as
    torchtitan does). Raises ValueError for an id that names no step, and what ``dcp.save``
    raises (``CheckpointException``) when the save fails; the previous step is untouched.
    """
    writer = StorageWriter(_step(checkpoint_id), checkpointer=checkpointer)
    if async_mode == "async":
        fut: Any = _dcp_async_save(
            state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
            process_group=process_group,
        )  # fmt: skip
        return fut  # type: ignore[no-any-return]
    if async_mode != "disabled":
        raise ValueError(f"async_mode must be 'disabled' or 'async', got {async_mode!r}")
    _dcp_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
    return None


def dcp_load(
    state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], checkpointer: Checkpointer
) -> None:
    """Load the step of ``checkpoint_id`` into ``state_dict`` in place (DCP reshards; Stateful
    values get ``load_state_dict``). Raises :class:`strata.errors.RestoreError` when that step
    cannot be read verified from any tier this rank reads."""
    reader = StorageReader(_step(checkpoint_id), checkpointer=checkpointer)
    _dcp_load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id)


def find_load_step(checkpointer: Checkpointer) -> int:
    """The newest step to resume from, or -1 when there is none (torchtitan's convention): the
    step :class:`strata.dcp.StorageReader` with ``step=None`` loads (the newest step complete
    in one tier this rank reads)."""
    try:
        return StorageReader(checkpointer=checkpointer)._choose_step()
    except RestoreError:
        return -1
