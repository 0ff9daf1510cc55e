"""Best-effort push of :class:`~strata.reports.SidecarReport` to the operator over HTTPS.

``POST <report.endpoint>/v1/reports`` with ``Authorization: Bearer <token>``; the token is re-read
from ``report.token_path`` for every request because projected service-account tokens rotate
(kubelet refreshes the file at 80 % of its lifetime). The server certificate is checked against
``report.ca_path`` (or the system trust store when unset).

Reports never block checkpointing: :meth:`Reporter.submit` only enqueues into a bounded queue
(the oldest report is dropped on overflow, since a newer report supersedes it) and a daemon thread
sends. A send is tried up to ``report.max_attempts`` times on connection errors, 408, 429 and 5xx;
other 4xx (bad token, schema) are logged and dropped. The retry is ``tenacity``'s: the wait before
retry n is ``d/2 + uniform(0, d)`` with ``d = min(backoff * 2^(n-1), max_backoff)``, i.e.
``d * uniform(0.5, 1.5)`` ("equal jitter", which spreads the sidecars of a job that all lost the
operator at once); a sidecar that is stopping ends the wait at once and drops the report.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import tenacity

from strata.config import ReportConfig
from strata.errors import StrataError
from strata.reports import REPORT_PATH, SidecarReport

log = logging.getLogger("strata.sidecar.reporter")

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class Reporter:
    """Background sender of reports; ``submit`` is non-blocking and thread-safe."""

    def __init__(
        self,
        config: ReportConfig,
        *,
        queue_size: int = 32,
        backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 30.0,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        if not config.endpoint:
            raise ValueError("report.endpoint is not set; the reporter is disabled without it")
        self.config = config
        self.url = config.endpoint.rstrip("/") + REPORT_PATH
        self._queue: queue.Queue[SidecarReport] = queue.Queue(maxsize=queue_size)
        self._backoff = backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._on_drop = on_drop
        self._stop = threading.Event()
        self.sent = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="strata-reporter", daemon=True)
        self._thread.start()

    def submit(self, report: SidecarReport) -> None:
        """Enqueue ``report``; drops the oldest queued report when the queue is full."""
        while True:
            try:
                self._queue.put_nowait(report)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self._dropped("queue full")
                except queue.Empty:
                    pass

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued within ``timeout`` seconds, then stop the thread."""
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.1)

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        log.warning("report dropped: %s", why, extra={"event": "report_dropped", "reason": why})
        if self._on_drop is not None:
            self._on_drop(why)

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.config.ca_path)

    def _token(self) -> str:
        path = Path(self.config.token_path)
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ReportError(
                f"cannot read the report token {path} ({exc.strerror}); the webhook mounts a "
                "projected service-account token there"
            ) from exc

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                report = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self._send_with_retry(report)

    def _send_with_retry(self, report: SidecarReport) -> None:
        body = report.model_dump_json().encode()
        attempts = self.config.max_attempts
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, ReportError) and e.retryable),
            stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_when_event_set(self._stop),
            wait=backoff(self._backoff, self._max_backoff),
            sleep=self._sleep,
            before_sleep=_log_retry,
            reraise=True,
        )
        try:
            retrying(self._post, body)
        except ReportError as exc:
            attempt = retrying.statistics.get("attempt_number", 1)
            if exc.retryable and attempt < attempts:  # stopped by the stop event
                self._dropped("sidecar stopping")
            else:
                self._dropped(f"{exc} (attempt {attempt}/{attempts})")
            return
        except _Stopping:
            self._dropped("sidecar stopping")
            return
        self.sent += 1

    def _sleep(self, seconds: float) -> None:
        """tenacity's sleep: wait on the stop event, so that close() does not wait a backoff."""
        if self._stop.wait(seconds):
            raise _Stopping

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self._token()}",
            },
        )
        try:
            with urllib.request.urlopen(
                request, timeout=self.config.timeout_seconds, context=self._ssl_context()
            ) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:512].decode(errors="replace")
            raise ReportError(
                f"POST {self.url} -> HTTP {exc.code}: {detail}",
                retryable=exc.code in _RETRYABLE_STATUS,
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ReportError(f"POST {self.url} failed: {exc}", retryable=True) from None


def backoff(initial: float, maximum: float) -> tenacity.wait.wait_base:
    """The wait before retry n (seconds): ``d * uniform(0.5, 1.5)``, ``d = min(initial * 2^(n-1),
    maximum)``, written as tenacity's ``d/2 + uniform(0, d)``."""
    return tenacity.wait_exponential(multiplier=initial / 2, max=maximum / 2) + (
        tenacity.wait_random_exponential(multiplier=initial, max=maximum)
    )


def _log_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.info("report attempt %d failed: %s; retrying in %.1fs", state.attempt_number, exc, delay)


class _Stopping(Exception):
    """The stop event was set during a backoff wait."""


class ReportError(StrataError, RuntimeError):
    """A report to the operator failed; ``retryable``: whether sending it again may succeed
    (the receiver was unreachable, or answered a transient HTTP status)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
