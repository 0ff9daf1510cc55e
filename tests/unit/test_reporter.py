"""The sidecar's report retry (tenacity): which failures are retried, how long it waits, and that a
stopping sidecar drops the report at once instead of sleeping a backoff."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import tenacity

from strata.config import ReportConfig
from strata.reports import SidecarReport
from strata.sidecar.reporter import Reporter, ReportError, backoff

pytestmark = pytest.mark.unit

REPORT = SidecarReport(policy="fast", namespace="ns", pod_name="train-0", job_id="ns.job")


class ScriptedReporter(Reporter):
    """A Reporter whose POSTs fail with ``failures`` in turn, then succeed."""

    def __init__(self, failures: list[ReportError], *, backoff_seconds: float) -> None:
        self.failures = list(failures)
        self.posts = 0
        self.drops: list[str] = []
        self.posting = threading.Event()
        super().__init__(
            ReportConfig(endpoint="https://operator.invalid", max_attempts=3),
            on_drop=self.drops.append,
            backoff_seconds=backoff_seconds,
        )

    def _post(self, body: bytes) -> None:
        assert b'"pod_name":"train-0"' in body
        self.posts += 1
        self.posting.set()
        if self.failures:
            raise self.failures.pop(0)


@pytest.fixture
def reporters() -> Iterator[list[ScriptedReporter]]:
    made: list[ScriptedReporter] = []
    yield made
    for r in made:
        r.close(timeout=0.1)


def make(
    made: list[ScriptedReporter], failures: list[ReportError], backoff_seconds: float = 0.001
) -> ScriptedReporter:
    r = ScriptedReporter(failures, backoff_seconds=backoff_seconds)
    made.append(r)
    return r


def test_retryable_failures_are_retried_until_the_post_succeeds(
    reporters: list[ScriptedReporter],
) -> None:
    r = make(reporters, [ReportError("503", retryable=True), ReportError("reset", retryable=True)])
    r._send_with_retry(REPORT)
    assert (r.posts, r.sent, r.drops) == (3, 1, [])


def test_a_report_is_dropped_after_max_attempts_naming_the_last_error(
    reporters: list[ScriptedReporter],
) -> None:
    r = make(reporters, [ReportError(f"HTTP 503 #{i}", retryable=True) for i in range(5)])
    r._send_with_retry(REPORT)
    assert r.posts == 3 and r.sent == 0
    assert r.drops == ["HTTP 503 #2 (attempt 3/3)"]


def test_a_non_retryable_error_is_dropped_after_one_attempt(
    reporters: list[ScriptedReporter],
) -> None:
    r = make(reporters, [ReportError("HTTP 401: bad token", retryable=False)])
    r._send_with_retry(REPORT)
    assert r.posts == 1 and r.drops == ["HTTP 401: bad token (attempt 1/3)"]


def test_a_stopping_sidecar_drops_the_report_without_waiting_the_backoff(
    reporters: list[ScriptedReporter],
) -> None:
    r = make(reporters, [ReportError("down", retryable=True)] * 3, backoff_seconds=60.0)
    r.submit(REPORT)
    assert r.posting.wait(5)
    start = time.monotonic()
    r.close(timeout=0.0)
    r._thread.join(5)
    assert time.monotonic() - start < 5  # not the 30-90 s of the first backoff
    assert r.posts == 1 and r.drops == ["sidecar stopping"]


def test_the_backoff_doubles_up_to_its_cap_with_half_to_one_and_a_half_jitter() -> None:
    wait = backoff(0.5, 30.0)
    for attempt, base in [(1, 0.5), (2, 1.0), (3, 2.0), (7, 30.0), (20, 30.0)]:
        state = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        waits = [wait(state) for _ in range(200)]
        assert all(0.5 * base <= w <= 1.5 * base for w in waits), (attempt, min(waits), max(waits))
        assert max(waits) - min(waits) > 0.5 * base  # jittered, not one fixed delay
