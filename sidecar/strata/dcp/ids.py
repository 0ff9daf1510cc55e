"""DCP ``checkpoint_id`` <-> Strata step: the ids ``dcp.save`` / ``dcp.load`` may be given.

Strata names a checkpoint by its step; DCP names it by a ``checkpoint_id``, which trainers build
as a path. Accepted, with the step they mean:

- ``"100"`` (the step itself; also ``100`` as an int);
- torchtitan's path-style ids: ``"step-100"``, ``"<folder>/step-100"``, ``"<folder>/step-100/"``
  or a :class:`os.PathLike` of them (``CheckpointManager._create_checkpoint_id`` joins its
  ``checkpoint.folder`` with ``f"step-{step}"``). The folder names no location: Strata's tiers
  are configured on the Checkpointer (RAM, PVC, GCS), not by the id.

Anything else is refused (``validate_checkpoint_id`` is False, ``reset`` raises ValueError), so
that an id meant for another storage is never silently written as some step.
"""

from __future__ import annotations

import os
import re

_ID = re.compile(r"^(?:.*[/\\])?(?:step-)?(\d+)[/\\]?$")


def step_of_checkpoint_id(checkpoint_id: str | os.PathLike[str] | int) -> int | None:
    """The step named by ``checkpoint_id`` (see the module docstring), or None when it names
    none. Pure."""
    if isinstance(checkpoint_id, bool):
        return None
    if isinstance(checkpoint_id, int):
        return checkpoint_id if checkpoint_id >= 0 else None
    m = _ID.match(os.fspath(checkpoint_id))
    return int(m.group(1)) if m else None


def checkpoint_id_of(step: int, folder: str | os.PathLike[str] = "") -> str:
    """The path-style id of ``step`` (``"<folder>/step-<step>"``; just ``"step-<step>"`` without
    a folder), as torchtitan builds it."""
    return os.path.join(os.fspath(folder), f"step-{step}")
