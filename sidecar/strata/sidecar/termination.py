"""The termination flush of the sidecar: started by the trainer's notice, bounded by the grace period.

When Kubernetes terminates a pod it sends SIGTERM to the main containers first; a native sidecar
(an init container with ``restartPolicy: Always``) gets its own SIGTERM only after every main
container exited, with whatever is left of ``terminationGracePeriodSeconds`` (on a real kubelet:
2 s after a trainer that used the whole period). So the sidecar learns of the termination from
the trainer (``POST /v1/terminate``, sent by :mod:`strata.client.termination` from its SIGTERM
handler) and starts the flush at once; its own SIGTERM only joins the flush in progress.

:class:`TerminationFlush` owns that flush: one deadline for the pod (the first notice's
signal time + grace period - margin; a later notice can only bring it forward), one flush thread
at a time running :meth:`strata.sidecar.promotion.PromotionEngine.flush` until no newer request
is pending (a trainer's final save after the notice is flushed by the next pass), and the
outcome of every pass. The thread is started from an unthrottled thread (a local API handler or
the main thread), so it and the copy threads it starts never run at the steady-state promotion's
idle priority (:mod:`strata.sidecar.priority`).

:class:`FlushMeter` keeps the throughput of recent promotions to the fastest durable tier and
estimates whether a flush of the current state fits in the grace period
(:class:`strata.reports.FlushEstimate`, reported to the operator).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from strata.config import TierName
from strata.reports import FlushEstimate
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.sidecar.promotion.flush import FlushResult

log = logging.getLogger("strata.sidecar")

MIN_FLUSH_SECONDS = 1.0
"""A flush gets at least this long even when the deadline has passed (a kubelet still gives a
native sidecar 2 s after the main containers used the whole grace period)."""
HOLD_MAX_SECONDS = 10.0
"""Longest hold of the first pass for a trainer that announced its final save (``hold``)."""
HOLD_FRACTION = 0.4
"""... and at most this fraction of the time left to the deadline."""
METER_WINDOW = 8
"""Promotions whose bytes and seconds make the throughput figure."""


@dataclass(frozen=True)
class FlushOutcome:
    """One finished pass of the termination flush."""

    result: FlushResult
    seconds: float
    """Wall time of the pass."""
    fit: bool
    """It succeeded and finished before the deadline."""
    finished_at: float
    """On the flush's clock (``time.monotonic``)."""

    @property
    def durable_step(self) -> int | None:
        """Newest local step on the target tier after this pass (None: none)."""
        r = self.result
        if r.ok and r.ram_step is not None:
            return max(r.ram_step, r.durable_step) if r.durable_step is not None else r.ram_step
        return r.durable_step


class FlushMeter:
    """Throughput of promotions to one tier and the flush estimate built on it (thread-safe)."""

    def __init__(self, tier: TierName | None, grace_seconds: float, margin_seconds: float) -> None:
        self.tier = tier
        self.grace_seconds = grace_seconds
        self.budget_seconds = max(0.0, grace_seconds - margin_seconds)
        self._lock = threading.Lock()
        self._samples: deque[tuple[int, float]] = deque(maxlen=METER_WINDOW)
        self._state_bytes: int | None = None
        self._last: FlushOutcome | None = None

    def on_promotion_event(self, event: PromotionEvent) -> None:
        if event.kind != "promoted" or event.tier != self.tier or event.nbytes <= 0:
            return
        with self._lock:
            self._samples.append((event.nbytes, max(event.seconds, 1e-6)))
            self._state_bytes = event.nbytes

    def on_flush(self, outcome: FlushOutcome) -> None:
        with self._lock:
            self._last = outcome

    def estimate(self) -> FlushEstimate:
        """The estimate now: ``seconds_needed`` against ``budget_seconds`` (see
        :class:`strata.reports.FlushEstimate`)."""
        with self._lock:
            samples, state, last = list(self._samples), self._state_bytes, self._last
        rate = needed = None
        if samples:
            rate = sum(n for n, _ in samples) / sum(s for _, s in samples)
            if state is not None:
                needed = state / rate
        return FlushEstimate(
            tier=self.tier,
            state_bytes=state,
            bytes_per_second=rate,
            seconds_needed=needed,
            grace_seconds=self.grace_seconds,
            budget_seconds=self.budget_seconds,
            fits=None if needed is None else needed <= self.budget_seconds,
            last_ok=None if last is None else last.result.ok,
            last_fit=None if last is None else last.fit,
            last_step=None if last is None else last.result.ram_step,
            last_seconds=None if last is None else last.seconds,
        )


class TerminationFlush:
    """The pod's termination flush (see the module docstring). Thread-safe.

    ``grace_seconds``: the pod's ``terminationGracePeriodSeconds``; ``margin_seconds``: kept
    between the flush deadline and the pod's SIGKILL (last report, exit). ``on_outcome`` is
    called after every pass (logging, reports); it must not raise.
    """

    def __init__(
        self,
        engine: PromotionEngine,
        grace_seconds: float,
        margin_seconds: float,
        on_outcome: Callable[[FlushOutcome], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.grace_seconds = grace_seconds
        self.margin_seconds = margin_seconds
        self._on_outcome = on_outcome
        self._clock = clock
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._pending = False
        self._running = False
        self._passes = 0
        self._last: FlushOutcome | None = None
        self._thread: threading.Thread | None = None
        self._hold_until: float | None = None

    @property
    def noticed(self) -> bool:
        """A termination notice (the trainer's or the sidecar's own SIGTERM) arrived."""
        with self._cond:
            return self._deadline is not None

    @property
    def last(self) -> FlushOutcome | None:
        with self._cond:
            return self._last

    def deadline(self) -> float | None:
        """The flush deadline on the flush's clock (None before any notice)."""
        with self._cond:
            return self._deadline

    def notice(
        self, since_signal_seconds: float = 0.0, source: str = "trainer", hold: bool = False
    ) -> float:
        """The pod is terminating, its SIGTERM ``since_signal_seconds`` ago: fix the deadline
        (only ever brought forward) and make sure a flush pass starts now. Returns the deadline.

        ``hold``: the trainer announced a final save (its loop polls ``should_stop``): before
        any pass ran, the first pass waits for a notice without ``hold`` (the trainer's request
        for its final step, or the sidecar's SIGTERM), at most :data:`HOLD_MAX_SECONDS` and
        :data:`HOLD_FRACTION` of the time left, so that a large state is not copied twice (the
        newest committed step, then the final one) within one grace period."""
        now = self._clock()
        proposed = now - since_signal_seconds + self.grace_seconds - self.margin_seconds
        with self._cond:
            first = self._deadline is None
            deadline = proposed if self._deadline is None else min(self._deadline, proposed)
            self._deadline = deadline
            self._pending = True
            if hold and first:
                self._hold_until = now + min(HOLD_MAX_SECONDS, HOLD_FRACTION * (deadline - now))
            elif not hold:
                self._hold_until = None
                self._cond.notify_all()
            if not self._running:
                self._running = True
                self._thread = threading.Thread(
                    target=self._run, name="strata-termination-flush", daemon=True
                )
                self._thread.start()
        if first:
            log.warning(
                "termination notice from the %s: flushing the newest RAM step now (%.1fs to the "
                "deadline)",
                source,
                deadline - now,
                extra={"event": "termination_notice", "source": source},
            )
        return deadline

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._hold_until is not None and self._clock() < self._hold_until:
                    self._cond.wait(min(0.1, self._hold_until - self._clock()))
                self._hold_until = None
                if not self._pending:
                    self._running = False
                    self._cond.notify_all()
                    return
                self._pending = False
                deadline = self._deadline
            assert deadline is not None
            started = self._clock()
            try:
                result = self.engine.flush(max(deadline, started + MIN_FLUSH_SECONDS))
            except Exception as exc:  # engine.flush never raises; a bug must still end the wait
                log.exception("termination flush failed")
                result = FlushResult(None, None, None, ok=False, message=f"internal error: {exc}")
            finished = self._clock()
            outcome = FlushOutcome(
                result, finished - started, result.ok and finished <= deadline, finished
            )
            with self._cond:
                self._last = outcome
                self._passes += 1
                self._cond.notify_all()
            if self._on_outcome is not None:
                try:
                    self._on_outcome(outcome)
                except Exception:
                    log.exception("termination flush outcome handler failed")

    def wait(self, step: int | None, timeout: float) -> FlushOutcome | None:
        """Wait up to ``timeout`` seconds until a pass made ``step`` durable (or a newer step),
        or, for ``step`` None or a pass that failed, until no pass is pending or running.
        Returns the last outcome (None: no pass finished)."""
        end = self._clock() + max(0.0, timeout)

        def settled() -> bool:
            last = self._last
            if step is not None and last is not None:
                durable = last.durable_step
                if durable is not None and durable >= step:
                    return True
            return not self._running and not self._pending

        with self._cond:
            while not settled():
                left = end - self._clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            return self._last

    def state(self) -> tuple[bool, bool]:
        """(started, done): a pass ran or runs; nothing runs or is pending."""
        with self._cond:
            started = self._running or self._passes > 0
            return started, started and not self._running and not self._pending
