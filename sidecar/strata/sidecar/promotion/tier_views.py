"""What each durable tier holds of the current incarnation: :class:`TierViews`.

Per durable tier a :class:`~strata.sidecar.promotion.progress.TierProgress`: its live committed
steps (commit records whose incarnation is live in the current incarnation's lineage), the
lineage itself, and whether the tier names an incarnation newer than this node's (*behind*:
nothing is promoted, replaced or deleted there until this node's trainer restores). Shards of a superseded incarnation are removed before a step is
placed again (:meth:`TierViews.drop_superseded`). A view is
(re-)read when the ranks are first known and whenever the current incarnation changes
(:meth:`TierViews.init`), and after a promotion or retention (:meth:`TierViews.refresh`).
Work on a tier is serialised by the engine's tier lock; ``emit`` gets the "superseded" events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from strata.config import TierName
from strata.errors import ShardUnavailable, TierError
from strata.sidecar.promotion.events import PromotionEvent
from strata.sidecar.promotion.progress import TierProgress
from strata.sidecar.promotion.world import World
from strata.tiers.base import Tier
from strata.tiers.eligible import job_lineage, tier_steps

log = logging.getLogger("strata.promotion")


class TierViews:
    """Views of the tiers ``durable`` of job ``job_id``; ``world()``: the current snapshot of
    this node's incarnation (:class:`strata.sidecar.promotion.world.World`)."""

    def __init__(
        self,
        job_id: str,
        durable: Mapping[TierName, Tier],
        world: Callable[[], World],
        emit: Callable[[PromotionEvent], None],
    ) -> None:
        self.job_id = job_id
        self.durable = durable
        self._world = world
        self._emit = emit
        self.progress: dict[TierName, TierProgress] = {t: TierProgress() for t in durable}

    def world(self) -> World:
        """The current snapshot of this node's incarnation, which the views judge by."""
        return self._world()

    def init(self, name: TierName, ranks: set[int]) -> bool:
        """Start a durable tier's interval from its newest live committed step (once the ranks
        are known, and again whenever the current incarnation changes); False while the tier
        cannot be read."""
        progress = self.progress[name]
        if progress.initialised and progress.incarnation == self._world().incarnation:
            return True
        if not ranks:
            return False
        if not self.refresh(name):
            return False
        progress.initialised = True
        return True

    def refresh(self, name: TierName) -> bool:
        """Re-read the tier's commit records and incarnation records: its live committed steps
        of the current incarnation's lineage. False when it cannot be read (the previous view
        stays)."""
        tier = self.durable[name]
        progress = self.progress[name]
        world = self._world()
        try:
            lin = job_lineage([tier], self.job_id, current=world.incarnation, extra=world.records)
            steps = tier_steps(tier, self.job_id, lin)
        except TierError as exc:
            log.warning("cannot read the %s tier's commits yet: %s", name, exc)
            return False
        progress.incarnation = world.incarnation
        progress.lineage = lin
        newest = max(lin.records, default=None)
        current = world.incarnation
        was = progress.behind
        progress.behind = (
            newest if current is not None and newest is not None and newest > current else None
        )
        if progress.behind is not None and progress.behind != was:
            log.warning(
                "the %s tier names incarnation %s, newer than this node's %s: not promoting "
                "there until this node's trainer restores",
                name,
                newest,
                current,
                extra={"event": "incarnation_behind", "tier": name},
            )
        progress.dead = steps.dead
        progress.set_committed(steps.eligible)
        return True

    def last_promoted(self) -> dict[TierName, int | None]:
        """Per tier, its newest live committed step (None: none)."""
        return {name: p.last_step for name, p in self.progress.items()}

    def newest_durable_step(self, tier: TierName) -> int | None:
        """Newest step committed on a durable tier: what this engine promoted or found at
        start, and a fresh read of ``tier``."""
        known = [p.last_step for p in self.progress.values() if p.last_step is not None]
        listed = self.progress[tier].last_step if self.refresh(tier) else None
        if listed is not None:
            known.append(listed)
        return max(known) if known else None

    def drop_superseded(self, name: TierName, step: int, ranks: list[int]) -> None:
        """Remove the shards of ``step`` for ``ranks`` that a superseded incarnation wrote to
        ``name`` (a replay rewrites the step): they can never be restored, and GCS never
        overwrites an object. Failures are logged, never raised."""
        tier = self.durable[name]
        lin = self.progress[name].lineage
        current = self._world().incarnation
        for rank in ranks:
            try:
                there = tier.get_manifest(self.job_id, step, rank)
            except ShardUnavailable:
                continue
            if current is None or there.incarnation == current or lin.live(there.incarnation, step):
                continue
            why = lin.why_dead(there.incarnation, step)
            try:
                tier.delete_step(self.job_id, step, frozenset({rank}))
            except TierError as exc:
                log.warning("cannot remove superseded rank %d of step %d: %s", rank, step, exc)
                continue
            log.info(
                "removed rank %d of step %d from %s: %s",
                rank,
                step,
                name,
                why,
                extra={"event": "superseded", "tier": name, "step": step, "rank": rank},
            )
            self._emit(PromotionEvent("superseded", name, step, (rank,), message=why))
