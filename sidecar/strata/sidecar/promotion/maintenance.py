"""Maintenance of one durable tier: :class:`Maintenance` (after a promotion there, and every
``every_seconds``).

In this order, each part under the tier's lock: settle the commit records still missing of
steps newer than the tier's newest commit (:meth:`TierRound.commit_missing`), back-fill live
steps of earlier incarnations from a faster tier (:class:`~strata.sidecar.promotion.backfill.Backfill`),
collect superseded steps (:class:`~strata.sidecar.promotion.collection.Collector`), then
retention and garbage collection for the local ranks
(:class:`~strata.sidecar.promotion.retention.Retention`). The tier's view is re-read when
anything was deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from strata.config import TierName
from strata.sidecar.promotion.backfill import Backfill
from strata.sidecar.promotion.collection import Collector
from strata.sidecar.promotion.events import RoundResult
from strata.sidecar.promotion.policies import RetentionPolicy
from strata.sidecar.promotion.retention import Retention
from strata.sidecar.promotion.tier_views import TierViews


class Maintenance:
    """Maintains the durable tiers of ``views`` (their live committed steps; each tier's
    ``last_maintenance`` and ``first_seen`` live there).

    ``commit_missing(tier, result)``: settles missing commit records; ``keep``: each tier's
    retention policy, which ``retention`` applies; ``clock``: monotonic
    seconds (``every_seconds`` is on it); ``wall_clock``: seconds since the epoch (retention's
    grace period).
    """

    def __init__(
        self,
        views: TierViews,
        keep: Mapping[TierName, RetentionPolicy],
        commit_missing: Callable[[TierName, RoundResult], None],
        *,
        backfill: Backfill,
        collector: Collector,
        retention: Retention,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        every_seconds: float,
    ) -> None:
        self.views = views
        self.keep = keep
        self._commit_missing = commit_missing
        self.backfill = backfill
        self.collector = collector
        self.retention = retention
        self._clock = clock
        self._wall = wall_clock
        self.every_seconds = every_seconds

    def run_if_due(self, name: TierName, ranks: set[int], result: RoundResult) -> None:
        """Maintain tier ``name`` for the local ``ranks`` when this round promoted a step there
        (``result.promoted``) or ``every_seconds`` passed since its last maintenance; what was
        committed or deleted goes to ``result``. Never raises a tier error."""
        p = self.views.progress[name]
        now = self._clock()
        if not (
            name in result.promoted
            or p.last_maintenance is None
            or now - p.last_maintenance >= self.every_seconds
        ):
            return
        p.last_maintenance = now
        self._commit_missing(name, result)
        self.backfill.run(name, ranks, result)
        collected = self.collector.collect(name, result)
        deleted = self.retention.maintain(
            self.views.durable[name],
            ranks,
            self.keep[name],
            now=self._wall(),
            first_seen=p.first_seen,
            complete=set(p.committed),
        )
        result.add_deleted(name, deleted)
        if deleted or collected:
            self.views.refresh(name)
