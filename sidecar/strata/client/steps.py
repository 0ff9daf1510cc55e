"""Which steps a job has, and restoring one chosen step: the step-listing part of the client API.

:meth:`strata.Checkpointer.all_steps`, :meth:`~strata.Checkpointer.latest_step` and
``Checkpointer.restore(state, step=N)`` are one-line calls into this module. Their equivalents
elsewhere:

===============================  ===========================================  ============================
Strata                           Orbax ``CheckpointManager``                  torch DCP / torchtitan
===============================  ===========================================  ============================
``ckpt.all_steps()``             ``mngr.all_steps()``                         listing ``step-N`` folders
``ckpt.all_steps("pvc")``        (one directory: no tiers)                    (one folder: no tiers)
``ckpt.latest_step()``           ``mngr.latest_step()``                       ``CheckpointManager._find_load_step()``
``ckpt.restore(state)``          ``mngr.restore(mngr.latest_step(), ...)``    ``dcp.load(sd, checkpoint_id=...)``
``ckpt.restore(state, step=N)``  ``mngr.restore(N, ...)``                     ``--checkpoint.load_step N``
===============================  ===========================================  ============================

Semantics (all computed from this rank's inventory: what the sidecar, or the tiers themselves
without one, list as *committed*, i.e. with a manifest; in-flight and partial steps never count):

- ``all_steps(tier)``: the steps committed in ``tier``, ascending. A shared tier (``pvc``,
  ``gcs``) counts a step when it is complete there (every rank 0..W-1 committed, at this world
  size); a node-local tier (``ram``, ``peer``) when *this rank's* shard is committed there (the
  other ranks' RAM is on their own nodes).
- ``all_steps()``: the steps restorable as this rank sees them (every rank's shard readable in
  some tier, one live incarnation: :func:`strata.restore.restorable_steps`), ascending. With
  torch.distributed, ``restore()`` gathers every rank's inventory and may find more (another
  rank's RAM); without it, this is what a restore can load.
- ``latest_step(tier=None)``: the last entry of ``all_steps(tier)``, or None.
- ``restore(state, step=N)``: the same restore as ``restore(state)`` (every rank agrees, nearest
  tier first, verified, a corrupt copy quarantined and the next tier tried) restricted to step
  ``N``; when ``N`` cannot be restored it raises :class:`strata.errors.RestoreError` naming the
  tiers searched, and never falls back to another step or to a fresh start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from strata.errors import RestoreError
from strata.restore import RankInventory, restorable_steps

NODE_LOCAL_TIERS: frozenset[str] = frozenset({"ram", "peer"})
"""Tiers that hold this node's shards only (a step counts when this rank's shard is there)."""


def check_step(step: int | None) -> None:
    """Raise ValueError unless ``step`` is None or a non-negative int (a bool is refused)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")


def committed_steps(
    inventory: RankInventory, world_size: int, tier: str | None, order: Sequence[str]
) -> list[int]:
    """The steps of ``inventory`` committed in ``tier`` (None: restorable), ascending.

    ``order``: the configured tiers in restore order (``StrataConfig.tiers_in_restore_order``).
    Raises ValueError for a tier that is not configured (naming the configured ones).
    """
    if tier is None:
        return sorted(restorable_steps([inventory], world_size, order))
    if tier not in order:
        raise ValueError(f"tier {tier!r} is not configured; configured tiers: {', '.join(order)}")
    held = inventory.committed.get(tier, {})
    unusable = inventory.unusable.get(tier, frozenset())
    if tier in NODE_LOCAL_TIERS:
        steps = [s for s, ranks in held.items() if inventory.rank in ranks]
    else:
        every = frozenset(range(world_size))
        steps = [s for s, ranks in held.items() if every <= ranks]
    return sorted(s for s in steps if s not in unusable)


def latest(steps: Sequence[int]) -> int | None:
    """The newest of ``steps`` (ascending), or None when there is none."""
    return steps[-1] if steps else None


def pin_step(inventories: list[RankInventory], step: int | None) -> list[RankInventory]:
    """The inventories restricted to ``step`` (None: unchanged), so that planning can only pick it.

    Partial steps and notes are kept (they are reported, never planned)."""
    if step is None:
        return inventories
    return [
        dataclasses.replace(
            inv,
            committed={
                t: {s: r for s, r in held.items() if s == step} for t, held in inv.committed.items()
            },
        )
        for inv in inventories
    ]


def not_restorable(
    job_id: str, step: int, world_size: int, searched: str, notes: list[str]
) -> RestoreError:
    """The error of ``restore(state, step=N)`` when step N cannot be restored."""
    return RestoreError(
        f"step {step} of job {job_id!r} is not restorable with world size {world_size} (searched "
        f"{searched}; notes: {'; '.join(notes) or 'none'}); list the restorable steps with "
        "Checkpointer.all_steps(), or call restore(state) for the newest"
    )
