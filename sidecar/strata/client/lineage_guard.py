"""Saves the sidecar would never promote: a process that saves without having restored.

The sidecar promotes only the steps of the node's *current incarnation*, the newest one named in
the RAM tier (:mod:`strata.sidecar.promotion.world`). A trainer process stamps its manifests with
the incarnation its :meth:`Checkpointer.restore` opened, ``""`` before any restore. Once any
restore on the node wrote an incarnation record of the job, shards stamped ``""`` are of no
current incarnation: they would stay in RAM for good, so such a save is refused instead
(:func:`unpromotable_save`).
"""

from __future__ import annotations

from strata.errors import TierError
from strata.format import layout
from strata.tiers.ram import RamTier


def unpromotable_save(ram: RamTier, job_id: str, incarnation: str, step: int) -> str | None:
    """Why a save of ``step`` by a process of ``incarnation`` would never be promoted, or None.

    ``incarnation``: the one the process's restore opened (``""``: it never restored). One
    listing of ``<ram>/<job>/incarnations/`` when ``incarnation`` is ``""``; nothing otherwise.
    A RAM tier that cannot be listed says nothing (None).
    """
    if incarnation:
        return None
    try:
        names = ram.list_records(layout.incarnations_prefix(job_id))
    except TierError:
        return None
    ids = sorted(i for n in names if (i := layout.parse_incarnation_name(n)) is not None)
    if not ids:
        return None
    return (
        f"Strata: step {step} of job {job_id!r} was not saved: this process never called "
        f"restore(), and a restore on this node already opened incarnation {ids[-1]!r} of the "
        "job, so the sidecar would never promote this process's steps out of RAM. Call "
        "Checkpointer.restore(state) once before the first save() (it returns a fresh start "
        "when nothing is restorable), or give this run its own job_id"
    )
