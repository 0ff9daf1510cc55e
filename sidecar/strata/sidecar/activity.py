"""What the sidecar did, for its metrics and its reports to the operator.

:class:`Activity` turns promotion events (:class:`~strata.sidecar.promotion.PromotionEvent`) and
the trainer's events (:mod:`strata.protocol`) into Prometheus metrics, keeps the recent ones
(at most ``MAX_EVENTS`` of each kind) for the next :class:`~strata.reports.SidecarReport`, and
lists the tiers for the report's per-tier state. Thread-safe: events arrive from the promotion
threads and the local API's handler threads.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence

from strata.config import SOURCE_ORDER, SourceName, StrataConfig, TierName
from strata.errors import TierError
from strata.protocol import RestoreEvent, SaveEvent
from strata.reports import MAX_EVENTS, Promotion, ReportedError, Restore, SidecarReport, TierState
from strata.sidecar.metrics import Metrics
from strata.sidecar.promotion import PromotionEvent
from strata.tiers.base import Tier

log = logging.getLogger("strata.sidecar")


class Activity:
    """Metrics and report material of one sidecar.

    ``tiers``: every tier, RAM first; ``local_ranks``: the ranks this sidecar serves (asked at
    each listing). ``report_due`` is set whenever something worth reporting happened.
    """

    def __init__(
        self,
        config: StrataConfig,
        metrics: Metrics,
        tiers: Sequence[Tier],
        local_ranks: Callable[[], set[int]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.tiers = list(tiers)
        self.local_ranks = local_ranks
        self.report_due = threading.Event()
        self._lock = threading.Lock()
        self._promotions: deque[Promotion] = deque(maxlen=MAX_EVENTS)
        self._restores: deque[Restore] = deque(maxlen=MAX_EVENTS)
        self._errors: deque[ReportedError] = deque(maxlen=MAX_EVENTS)
        self._tier_state_cache: dict[TierName, TierState] = {}
        self._too_small: dict[TierName, str] = {}
        self._newest_promoted: dict[TierName, int] = {}

    def on_promotion_event(self, event: PromotionEvent) -> None:
        m = self.metrics
        if event.kind in ("promoted", "backfilled") and event.step is not None:
            m.promotion_duration.labels(tier=event.tier).observe(event.seconds)
            m.promotion_bytes.labels(tier=event.tier).inc(event.nbytes)
            with self._lock:
                # the newest step: a back-filled older step never moves the gauge backwards
                newest = max(event.step, self._newest_promoted.get(event.tier, event.step))
                self._newest_promoted[event.tier] = newest
                m.last_committed_step.labels(tier=event.tier).set(newest)
                self._promotions.append(
                    Promotion(
                        tier=event.tier,
                        step=event.step,
                        bytes=event.nbytes,
                        seconds=event.seconds,
                    )
                )
            self.report_due.set()
        elif event.kind in ("failed", "gave_up"):
            m.promotion_failures.labels(tier=event.tier).inc()
            self.error(event.tier, f"step {event.step} ranks {list(event.ranks)}: {event.message}")
        elif event.kind == "checksum_mismatch":
            m.checksum_mismatches.labels(tier=event.tier).inc()
            self.error(event.tier, f"checksum mismatch, quarantined: {event.message}")
        elif event.kind in ("retention", "gc"):
            m.retention_deleted.labels(tier=event.tier, reason=event.kind).inc()
        elif event.kind == "too_small":
            # message "": the tier takes steps again.
            m.tier_too_small.labels(tier=event.tier).set(1 if event.message else 0)
            with self._lock:
                if event.message:
                    self._too_small[event.tier] = event.message
                else:
                    self._too_small.pop(event.tier, None)
            self.report_due.set()

    def error(self, tier: SourceName | None, message: str) -> None:
        with self._lock:
            self._errors.append(ReportedError(tier=tier, message=message[:2048]))
        self.report_due.set()

    def on_client_event(self, event: SaveEvent | RestoreEvent) -> None:
        if isinstance(event, SaveEvent):
            if not event.ok:
                self.error("ram", f"save of step {event.step} failed: {event.error}")
        else:
            restore = Restore(
                tier=_tier_name(event.tier),
                step=event.step,
                bytes=event.nbytes,
                seconds=event.seconds,
                outcome=event.outcome,
                skipped=[s[:512] for s in event.skipped][:MAX_EVENTS],
                rank=event.rank,
            )
            self.metrics.restore_total.labels(
                tier=restore.tier or "none", outcome=restore.outcome
            ).inc()
            for name in event.quarantined:  # found corrupt by the trainer's load, quarantined
                tier = _tier_name(name)
                if tier is not None:
                    self.metrics.checksum_mismatches.labels(tier=tier).inc()
                    self.error(
                        tier, f"checksum mismatch found by rank {event.rank}'s restore, quarantined"
                    )
            if restore.outcome == "restored" and restore.tier is not None:
                self.metrics.restore_duration.labels(tier=restore.tier).observe(restore.seconds)
            with self._lock:
                self._restores.append(restore)
            log.info(
                "client restore: %s step %s from %s",
                restore.outcome,
                restore.step,
                restore.tier,
                extra={"event": "client_restore", "tier": restore.tier, "step": restore.step},
            )
            self.report_due.set()

    def tier_states(self, only: Collection[str] | None = None) -> dict[TierName, TierState]:
        """Per tier: newest complete step, newest step holding all local shards, complete count.

        ``only``: tiers to list now; the others keep their last listed state (the final report
        at SIGTERM must not wait for an unreachable bucket).
        """
        ranks = self.local_ranks()
        out = dict(self._tier_state_cache)
        for tier in self.tiers:
            if only is not None and tier.name not in only:
                continue
            try:
                listings = tier.list_steps(self.config.job_id)
            except TierError as exc:
                log.warning("cannot list the %s tier for a report: %s", tier.name, exc)
                continue
            complete = sorted(s for s, li in listings.items() if li.complete)
            # The report counts a step once any local shard is committed (schema); the gauge
            # only once every local shard is.
            any_local = [s for s, li in listings.items() if ranks & li.committed_ranks]
            all_local = [s for s, li in listings.items() if ranks and ranks <= li.committed_ranks]
            state = TierState(
                newest_complete_step=complete[-1] if complete else None,
                newest_committed_step=max(any_local) if any_local else None,
                complete_steps=len(complete),
                too_small=self._too_small.get(tier.name),
            )
            out[tier.name] = state
            self._tier_state_cache[tier.name] = state
            if all_local:
                self.metrics.last_committed_step.labels(tier=tier.name).set(max(all_local))
        return out

    def build_report(self, only: Collection[str] | None = None) -> SidecarReport | None:
        c = self.config
        if not (c.policy and c.namespace and c.pod_name):
            return None
        with self._lock:
            promotions, restores, errors = (
                list(self._promotions),
                list(self._restores),
                list(self._errors),
            )
            self._promotions.clear()
            self._restores.clear()
            self._errors.clear()
        return SidecarReport(
            policy=c.policy,
            namespace=c.namespace,
            pod_name=c.pod_name,
            pod_uid=c.pod_uid,
            job_id=c.job_id,
            tiers=self.tier_states(only),
            promotions=promotions,
            restores=restores,
            errors=errors,
        )


def _tier_name(name: str | None) -> SourceName | None:
    """A tier name reported by a client, or None when it names no tier."""
    for tier in SOURCE_ORDER:
        if tier == name:
            return tier
    return None
