"""Prometheus metrics of the operator (prometheus_client), served on ``--metrics-port``.

Names follow the Prometheus conventions (``_total`` counters, ``_seconds`` histograms, base
units). Label values are small closed sets (kinds, outcomes, reasons), never object names, so the
series count stays bounded however many pods or policies there are.

======================================  =======================================================
metric                                  meaning
======================================  =======================================================
strata_admission_requests_total         admission reviews by ``kind`` and ``outcome``
                                        (injected, labelled, unchanged, denied, error)
strata_admission_duration_seconds       handler time of an admission review, by ``kind``
strata_reconcile_total                  CheckpointPolicy reconciles by ``outcome``
strata_reconcile_duration_seconds       reconcile time
strata_reports_received_total           sidecar reports accepted and folded into status
strata_reports_rejected_total           reports refused, by ``reason`` (missing-token,
                                        bad-token, malformed, namespace-mismatch,
                                        pod-mismatch, pod-not-found, policy-mismatch,
                                        policy-not-found, status-conflict)
strata_report_duration_seconds          time to authenticate, check and fold one report
strata_pods_uninjected_total            pods labelled for a policy seen running without the
                                        sidecar (webhook skipped, failurePolicy Ignore)
======================================  =======================================================
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

ADMISSION_REQUESTS = Counter(
    "strata_admission_requests",
    "Admission reviews handled by the Strata webhook.",
    ["kind", "outcome"],
)
ADMISSION_DURATION = Histogram(
    "strata_admission_duration_seconds",
    "Handler time of one admission review, seconds.",
    ["kind"],
    buckets=_LATENCY_BUCKETS,
)
RECONCILES = Counter("strata_reconcile", "CheckpointPolicy reconciles by outcome.", ["outcome"])
RECONCILE_DURATION = Histogram(
    "strata_reconcile_duration_seconds",
    "Time of one CheckpointPolicy reconcile, seconds.",
    buckets=_LATENCY_BUCKETS,
)
REPORTS_RECEIVED = Counter(
    "strata_reports_received", "Sidecar reports accepted and folded into policy status."
)
REPORTS_REJECTED = Counter(
    "strata_reports_rejected", "Sidecar reports refused, by reason.", ["reason"]
)
REPORT_DURATION = Histogram(
    "strata_report_duration_seconds",
    "Time to authenticate, check and fold one sidecar report, seconds.",
    buckets=_LATENCY_BUCKETS,
)
STATUS_PATCHES = Counter(
    "strata_report_status_patches",
    "Status patches the report receiver made (each folds every report queued for one policy).",
)
REPORTS_PER_PATCH = Histogram(
    "strata_reports_per_status_patch",
    "Reports folded into one status patch.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)
PODS_UNINJECTED = Counter(
    "strata_pods_uninjected",
    "Pods labelled for a CheckpointPolicy seen running without the Strata sidecar.",
)


@contextmanager
def timed_reconcile() -> Iterator[None]:
    """Count and time one reconcile: ``with timed_reconcile(): ...`` (outcome ok or error)."""
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        RECONCILES.labels(outcome="error").inc()
        raise
    else:
        RECONCILES.labels(outcome="ok").inc()
    finally:
        RECONCILE_DURATION.observe(time.perf_counter() - start)


def serve(port: int, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> None:
    """Serve ``/metrics`` over plain HTTP in a daemon thread (prometheus_client's server)."""
    start_http_server(port, addr=host, registry=registry)
