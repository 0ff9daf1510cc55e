"""Saves of a process that never restored: join the node's live incarnation, or be refused.

The sidecar promotes only the steps of the node's *current incarnation*, the newest one named in
the RAM tier (:mod:`strata.sidecar.promotion.world`). A trainer process stamps its manifests with
the incarnation its :meth:`Checkpointer.restore` opened, ``""`` before any restore. Once any
restore on the node wrote an incarnation record of the job, shards stamped ``""`` belong to no
current incarnation and would stay in RAM for good. So the first save of a process that never
restored joins the newest incarnation recorded on the node (:func:`join_or_refuse`) when it runs
at that incarnation's world size, and is refused otherwise (its steps could never be promoted).
"""

from __future__ import annotations

from strata.errors import TierError
from strata.tiers.ram import RamTier
from strata.tiers.records import read_incarnations


def join_or_refuse(
    ram: RamTier, job_id: str, incarnation: str, world_size: int, step: int
) -> tuple[str, str | None]:
    """(incarnation to stamp into the save of ``step``, why the save is refused or None).

    ``incarnation``: the one the process's restore opened (``""``: it never restored), returned
    as is when set or when the node has no incarnation record of ``job_id`` (nothing read but
    one listing of ``<ram>/<job>/incarnations/``). Otherwise the newest record's id when its
    world size is ``world_size``; a record of another world size refuses the save (the message
    starts with "Strata:" and says what to do). A RAM tier that cannot be read refuses nothing.
    """
    if incarnation:
        return incarnation, None
    try:
        records = read_incarnations(ram, job_id)
    except TierError:
        return incarnation, None
    if not records:
        return incarnation, None
    newest = max(records, key=lambda r: (r.created, r.id))
    if newest.world_size == world_size:
        return newest.id, None
    return incarnation, (
        f"Strata: step {step} of job {job_id!r} was not saved: this process never called "
        f"restore() and runs with world size {world_size}, while a restore on this node opened "
        f"incarnation {newest.id!r} at world size {newest.world_size}; the sidecar promotes only "
        "that incarnation's steps, so this process's would never leave RAM. Call "
        "Checkpointer.restore(state) once before the first save() (it returns a fresh start "
        "when nothing is restorable), or give this run its own job_id"
    )
