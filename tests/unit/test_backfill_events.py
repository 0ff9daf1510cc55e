"""A back-filled step is an older step than the tier may already hold, copied for ranks this pod
may not serve: it counts as bytes moved, but it never moves "the newest step in the tier" back
and it is no sample of this pod's own flush (pure logic; the engine emitting ``backfilled`` is
in tests/integration/test_maintenance_restart.py)."""

from __future__ import annotations

from strata.config import StrataConfig
from strata.sidecar.activity import Activity
from strata.sidecar.metrics import Metrics
from strata.sidecar.promotion import PromotionEvent
from strata.sidecar.termination import FlushMeter


def _sample(metrics: Metrics, name: str, tier: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"tier": tier})


def test_a_back_filled_older_step_never_moves_the_newest_step_gauge_back() -> None:
    metrics = Metrics()
    cfg = StrataConfig.parse({"job_id": "ns.j", "ram": {"path": "/dev/shm/unused"}})
    activity = Activity(cfg, metrics, [], local_ranks=set)
    activity.on_promotion_event(PromotionEvent("promoted", "gcs", 45, (0,), 100, 1.0))
    activity.on_promotion_event(PromotionEvent("backfilled", "gcs", 30, (0, 1), 300, 2.0))
    assert _sample(metrics, "strata_last_committed_step", "gcs") == 45
    # the bytes and the time of the back-fill are counted
    assert _sample(metrics, "strata_promotion_bytes_total", "gcs") == 400
    assert _sample(metrics, "strata_promotion_duration_seconds_count", "gcs") == 2
    # a back-fill newer than anything promoted here is the newest step
    activity.on_promotion_event(PromotionEvent("backfilled", "pvc", 60, (0,), 10, 1.0))
    assert _sample(metrics, "strata_last_committed_step", "pvc") == 60


def test_a_back_fill_is_no_sample_of_this_pods_flush() -> None:
    gib = 1 << 30
    meter = FlushMeter("pvc", grace_seconds=30.0, margin_seconds=5.0)
    meter.on_promotion_event(PromotionEvent("promoted", "pvc", 10, (0,), gib, 4.0))
    # ranks of a larger earlier world, copied by this pod: 8 GiB that are not this pod's state
    meter.on_promotion_event(PromotionEvent("backfilled", "pvc", 5, (0, 1, 2, 3), 8 * gib, 8.0))
    est = meter.estimate()
    assert est.state_bytes == gib and est.bytes_per_second == gib / 4.0, est
