"""The SIGTERM flush (C-14): before the pod dies, promote the newest committed RAM step to the
fastest durable tier, within a deadline, unless a durable tier already holds it or a newer one.

:func:`flush` sees the engine only through :class:`FlushTarget` (the
:class:`~strata.sidecar.promotion.round.PromotionEngine` is one): stop interval promotion, the
target tier and its lock, the clock, what RAM and the durable tiers hold, and one forced
promotion attempt. It retries a failed attempt with a doubling wait until the deadline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

from strata.config import TierName

FIRST_RETRY_SECONDS = 0.2
"""Wait after the first failed attempt; doubled after each, up to :data:`MAX_RETRY_SECONDS`."""
MAX_RETRY_SECONDS = 2.0
"""Longest wait between attempts (a full PVC stays full; a flaky one may recover)."""


@dataclass(frozen=True)
class FlushResult:
    """Outcome of :meth:`PromotionEngine.flush`."""

    tier: TierName | None
    ram_step: int | None
    durable_step: int | None
    """Newest step already on a durable tier before the flush."""
    ok: bool
    message: str
    nbytes: int = 0
    """Bytes of the shards this flush promoted (0: nothing promoted)."""


@dataclass(frozen=True)
class FlushView:
    """What a flush finds (:meth:`FlushTarget.flush_view`)."""

    ranks: set[int]
    """The local ranks of the current incarnation."""
    ram_step: int | None
    """Their newest step committed in RAM (None: none)."""
    durable_step: int | None
    """The newest step on a durable tier (None: none)."""


@dataclass(frozen=True)
class FlushAttempt:
    """One forced promotion (:meth:`FlushTarget.force_promote`)."""

    promoted: bool
    nbytes: int = 0
    """Bytes of the shards promoted."""
    failures: list[str] | None = None
    """Why it failed, where the tier said (None: the RAM step was not promotable yet)."""


class FlushTarget(Protocol):
    """What :func:`flush` needs of the promotion engine."""

    def stop_interval_promotion(self) -> None:
        """From now on only forced attempts promote."""

    def fastest_durable(self) -> TierName | None:
        """The tier to flush to (None: no durable tier)."""

    def tier_lock(self, name: TierName) -> threading.Lock:
        """The lock serialising work on tier ``name``."""

    def now(self) -> float:
        """The clock the deadline is on (seconds)."""

    def flush_view(self, tier: TierName) -> FlushView:
        """Under ``tier``'s lock: the local ranks, their newest RAM step, the newest durable."""

    def force_promote(self, tier: TierName, step: int, ranks: set[int]) -> FlushAttempt:
        """Under ``tier``'s lock: promote ``step`` of ``ranks`` now (backoff ignored, RAM
        shards without checksums checksummed). Never raises."""

    def holds(self, tier: TierName, step: int, ranks: set[int]) -> bool:
        """``step`` (or a newer one) is committed in ``tier`` by this engine, or the shards of
        every rank of ``ranks`` are placed there (the commit record may wait for others)."""


def flush(target: FlushTarget, deadline: float) -> FlushResult:
    """See :meth:`PromotionEngine.flush`."""
    target.stop_interval_promotion()
    tier = target.fastest_durable()
    if tier is None:
        return FlushResult(None, None, None, ok=True, message="no durable tier configured")
    lock = target.tier_lock(tier)
    if not lock.acquire(timeout=max(0.0, deadline - target.now())):
        return FlushResult(
            tier, None, None, ok=False, message=f"deadline passed waiting for the {tier} tier"
        )
    try:
        view = target.flush_view(tier)
        step, durable_step = view.ram_step, view.durable_step
        if step is None:
            return FlushResult(
                tier, None, durable_step, ok=True, message="RAM holds no committed step"
            )
        if durable_step is not None and step <= durable_step:
            return FlushResult(
                tier, step, durable_step, ok=True, message="durable tiers are current"
            )
        failures: list[str] = ["RAM step not promotable"]
        delay = FIRST_RETRY_SECONDS
        while True:
            # Shards that failed earlier may succeed now: the flush ignores their backoff.
            attempt = target.force_promote(tier, step, view.ranks)
            if attempt.promoted:
                return FlushResult(
                    tier, step, durable_step, ok=True, message="promoted", nbytes=attempt.nbytes
                )
            if target.holds(tier, step, view.ranks):
                # An earlier pass placed these shards (and this one may have just written the
                # step's commit record): nothing is left to copy.
                return FlushResult(
                    tier, step, step, ok=True, message="local shards already on the tier"
                )
            if attempt.failures is not None:
                failures = attempt.failures
            remaining = deadline - target.now()
            if remaining <= FIRST_RETRY_SECONDS:
                return FlushResult(tier, step, durable_step, ok=False, message="; ".join(failures))
            time.sleep(min(delay, remaining - FIRST_RETRY_SECONDS))
            delay = min(delay * 2, MAX_RETRY_SECONDS)
    finally:
        lock.release()
