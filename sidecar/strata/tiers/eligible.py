"""Which steps of a job a shared tier offers: the one rule that restore, reshard, the sidecar's
start-up prefetch, promotion (what to promote and back-fill) and ``strata plan`` all apply.

A step S of a shared tier (PVC, GCS) is **eligible** when both hold:

1. *committed*: its global commit record verifies (seal, job, step) and every rank it names has
   a committed manifest next to it (:func:`strata.tiers.records.committed_steps`);
2. *live*: the record's incarnation is live at S in the job's lineage
   (:meth:`strata.format.incarnation.Lineage.live`): written by the current incarnation, or by
   an ancestor at or below the step its successor on the chain resumed from.

A committed step that is not live is **dead**. A dead step is **superseded** (:func:`superseded`:
retention may collect it) only when the view that judged it cannot be out of date about it: its
incarnation is *older* than the lineage's current one (ids sort by creation time). Learning of
newer incarnations only shortens the live set of older ones (a restore resumes from a live step),
so a step superseded in one sidecar's view is dead in every later, fuller view. A step of an
incarnation newer than the view's current one (a sidecar that has not seen the newest record
yet) is dead to that view but never superseded: a fuller view may find it live.

The RAM tier has no commit record (it is per node): its steps are judged per shard by the
restore all-gather (:mod:`strata.restore.plan`), with the same :class:`Lineage`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from strata.format.commit import StepCommit
from strata.format.incarnation import Incarnation, Lineage
from strata.tiers.base import Tier
from strata.tiers.records import committed_steps, lineage

log = logging.getLogger("strata.records")

__all__ = ["TierSteps", "job_lineage", "superseded", "tier_steps"]


@dataclass(frozen=True)
class TierSteps:
    """A shared tier's committed steps of one job, split by the lineage (see the module
    docstring): ``eligible`` (live) and ``dead``, each step -> its commit record."""

    eligible: dict[int, StepCommit] = field(default_factory=dict)
    dead: dict[int, StepCommit] = field(default_factory=dict)

    @property
    def newest(self) -> int | None:
        """The newest eligible step (None: none)."""
        return max(self.eligible, default=None)


def job_lineage(
    tiers: Iterable[Tier],
    job_id: str,
    current: str | None = None,
    extra: Iterable[Incarnation] = (),
) -> Lineage:
    """The lineage from the incarnation records of every tier that can be read (plus ``extra``,
    e.g. the records of this node's RAM tier); ``current``: follow back from that incarnation
    (default: the newest record). Tiers that cannot be read are skipped (logged)."""
    return lineage(tiers, job_id, current=current, extra=extra)


def tier_steps(
    tier: Tier,
    job_id: str,
    lin: Lineage,
    steps: Iterable[int] | None = None,
    *,
    resumable: bool = False,
    world_size: int | None = None,
) -> TierSteps:
    """The committed steps of ``tier`` split into eligible and dead by ``lin``.

    ``steps``: only these (default: every step of the tier; costs as
    :func:`strata.tiers.records.committed_steps`: one record read and one listing per step with
    a record, never per shard). ``resumable``: leave out archive-only copies (never resumed).
    ``world_size``: only steps committed at that world size (None: any). Raises
    :class:`strata.errors.TierError` when the tier cannot be listed.
    """
    out = TierSteps()
    for s, c in committed_steps(tier, job_id, steps).items():
        if resumable and c.archive_only:
            continue
        if world_size is not None and c.world_size != world_size:
            continue
        if lin.live(c.incarnation, s):
            out.eligible[s] = c
        else:
            log.debug("%s: %s", tier.name, lin.why_dead(c.incarnation, s))
            out.dead[s] = c
    return out


def superseded(lin: Lineage, incarnation: str, step: int) -> bool:
    """Step ``step`` written by ``incarnation`` is dead in ``lin`` and stays dead whatever
    records this view has not seen yet (see the module docstring): retention may collect it.
    False when ``lin`` knows no incarnation at all (every step is live then)."""
    if lin.current is None or lin.live(incarnation, step):
        return False
    return incarnation < lin.current
