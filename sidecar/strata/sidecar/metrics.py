"""Prometheus metrics of the sidecar (``/metrics``), in base units with a ``strata_`` prefix.

One :class:`Metrics` owns its own ``CollectorRegistry`` so several sidecars (tests) never collide
in the process-global registry.

=====================================================  =========  ==============================
name                                                   type       labels
=====================================================  =========  ==============================
strata_save_stall_seconds                              histogram  (from client save reports)
strata_promotion_duration_seconds                      histogram  tier
strata_promotion_bytes_total                           counter    tier
strata_promotion_failures_total                        counter    tier
strata_last_committed_step                             gauge      tier
strata_restore_total                                   counter    tier, outcome (client reports)
strata_restore_duration_seconds                        histogram  tier (client reports)
strata_stage_total                                     counter    tier, outcome
strata_stage_duration_seconds                          histogram  tier
strata_checksum_mismatches_total                       counter    tier
strata_retention_deleted_steps_total                   counter    tier, reason
strata_tier_too_small                                  gauge      tier
strata_reports_dropped_total                           counter
strata_flush_seconds_needed                            gauge      (NaN until measured)
strata_flush_budget_seconds                            gauge
=====================================================  =========  ==============================

The two ``strata_flush_*`` gauges are the termination flush estimate
(:class:`strata.reports.FlushEstimate`): a flush of the current state would need more than
the budget (the grace period minus the sidecar's margin) when needed > budget.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Stall: sub-millisecond (pre-faulted slot copy of a small model) to tens of seconds.
_STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """The sidecar's metrics; ``render()`` gives the text exposition format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.save_stall = Histogram(
            "strata_save_stall_seconds",
            "Time save() blocked the training loop (snapshot into a RAM slot), seconds",
            buckets=_STALL_BUCKETS,
            registry=r,
        )
        self.promotion_duration = Histogram(
            "strata_promotion_duration_seconds",
            "Time to promote one step's local shards into a tier (copy + verify + commit), seconds",
            ["tier"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.promotion_bytes = Counter(
            "strata_promotion_bytes",
            "Shard bytes committed into a tier by promotion",
            ["tier"],
            registry=r,
        )
        self.promotion_failures = Counter(
            "strata_promotion_failures",
            "Shard promotions abandoned (I/O, fsync or verification error); retried from the source",
            ["tier"],
            registry=r,
        )
        self.last_committed_step = Gauge(
            "strata_last_committed_step",
            "Newest step whose local shards are all committed in the tier",
            ["tier"],
            registry=r,
        )
        self.restore_total = Counter(
            "strata_restore",
            "Trainer restores reported by the client, by serving tier (none: nothing restored) "
            "and outcome (restored, fresh-start, failed)",
            ["tier", "outcome"],
            registry=r,
        )
        self.restore_duration = Histogram(
            "strata_restore_duration_seconds",
            "Wall time of a trainer restore (inventory, staging, load) reported by the client, seconds",
            ["tier"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.stage_total = Counter(
            "strata_stage",
            "Shards staged into RAM by the sidecar, by serving tier (none: no tier could serve) "
            "and outcome (staged, failed)",
            ["tier", "outcome"],
            registry=r,
        )
        self.stage_duration = Histogram(
            "strata_stage_duration_seconds",
            "Time to stage one shard into RAM from a tier (copy and verify), seconds",
            ["tier"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.checksum_mismatches = Counter(
            "strata_checksum_mismatches",
            "Copies that failed CRC32C verification (quarantined)",
            ["tier"],
            registry=r,
        )
        self.retention_deleted = Counter(
            "strata_retention_deleted_steps",
            "Steps deleted from a tier by retention (reason=retention) or GC (reason=gc)",
            ["tier", "reason"],
            registry=r,
        )
        self.tier_too_small = Gauge(
            "strata_tier_too_small",
            "1 while the tier cannot take keep + 1 steps (promotion to it is stuck), else 0",
            ["tier"],
            registry=r,
        )
        self.reports_dropped = Counter(
            "strata_reports_dropped",
            "Operator reports dropped (queue full or retries exhausted)",
            registry=r,
        )
        self.flush_seconds_needed = Gauge(
            "strata_flush_seconds_needed",
            "Seconds a termination flush of the current state would take at the measured "
            "promotion throughput (NaN until a promotion was measured)",
            registry=r,
        )
        self.flush_budget_seconds = Gauge(
            "strata_flush_budget_seconds",
            "Seconds the termination flush may take: the grace period minus the sidecar's margin",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
