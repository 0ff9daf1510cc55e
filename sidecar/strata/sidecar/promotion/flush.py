"""The SIGTERM flush (C-14): before the pod dies, promote the newest committed RAM step to the
fastest durable tier, within a deadline, unless a durable tier already holds it or a newer one.

:func:`flush` takes the target tier, its lock and the clock, and sees the promotion parts only
through :class:`FlushTarget` (what RAM and the durable tiers hold, one forced promotion attempt);
:class:`TierFlush` is that target over the engine's parts. It retries a failed attempt with a
doubling wait until the deadline. Stopping interval promotion first is the caller's part
(:meth:`strata.sidecar.promotion.round.PromotionEngine.flush`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from strata.config import TierName
from strata.sidecar.promotion.copy import ShardCopier
from strata.sidecar.promotion.events import RoundResult
from strata.sidecar.promotion.ram_source import RamSource
from strata.sidecar.promotion.tier_round import TierRound
from strata.sidecar.promotion.tier_views import TierViews

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
    """What :func:`flush` needs of the promotion parts; called under the target tier's lock."""

    def flush_view(self, tier: TierName) -> FlushView:
        """The local ranks, their newest RAM step, the newest step on a durable tier."""

    def force_promote(self, tier: TierName, step: int, ranks: set[int]) -> FlushAttempt:
        """Promote ``step`` of ``ranks`` now (backoff ignored, RAM shards without checksums
        checksummed). Never raises."""

    def holds(self, tier: TierName, step: int, ranks: set[int]) -> bool:
        """``step`` (or a newer one) is committed in ``tier`` by this sidecar, or the shards of
        every rank of ``ranks`` are placed there (the commit record may wait for others)."""


def flush(
    target: FlushTarget,
    tier: TierName | None,
    locks: Mapping[TierName, threading.Lock],
    clock: Callable[[], float],
    deadline: float,
) -> FlushResult:
    """Flush to ``tier`` (None: no durable tier) under its lock of ``locks``; ``deadline`` is on
    ``clock`` (seconds). See :meth:`strata.sidecar.promotion.round.PromotionEngine.flush`."""
    if tier is None:
        return FlushResult(None, None, None, ok=True, message="no durable tier configured")
    lock = locks[tier]
    if not lock.acquire(timeout=max(0.0, deadline - clock())):
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
            remaining = deadline - clock()
            if remaining <= FIRST_RETRY_SECONDS:
                return FlushResult(tier, step, durable_step, ok=False, message="; ".join(failures))
            time.sleep(min(delay, remaining - FIRST_RETRY_SECONDS))
            delay = min(delay * 2, MAX_RETRY_SECONDS)
    finally:
        lock.release()


class TierFlush:
    """The promotion parts as a :class:`FlushTarget`: the RAM ``source``, the durable tiers'
    ``views``, the shard ``copier`` (its backoff is reset) and the per-tier ``rounds``."""

    def __init__(
        self, source: RamSource, views: TierViews, copier: ShardCopier, rounds: TierRound
    ) -> None:
        self.source = source
        self.views = views
        self.copier = copier
        self.rounds = rounds

    def flush_view(self, tier: TierName) -> FlushView:
        """The local ranks, their newest common RAM step and the newest step on a durable tier
        (one listing of the RAM tier, one read of ``tier``)."""
        listing = self.source.listing()
        ranks = self.source.local_ranks(listing)
        self.views.init(tier, ranks)
        step = max(self.source.steps_of(ranks, listing), default=None)
        return FlushView(ranks, step, self.views.newest_durable_step(tier))

    def force_promote(self, tier: TierName, step: int, ranks: set[int]) -> FlushAttempt:
        """One forced promotion of ``step`` for ``ranks``, ignoring the shards' backoff and
        checksumming RAM shards whose writer did not."""
        for rank in ranks:
            self.copier.reset(tier, step, rank)
        manifests = self.source.manifests(step, ranks, seal=True)
        if manifests is None:
            return FlushAttempt(False)
        result = RoundResult(ram_step=step)
        self.rounds.promote_if_due(tier, step, manifests, True, result)
        if result.promoted.get(tier) == step:
            return FlushAttempt(True, nbytes=sum(m.data_nbytes for m in manifests.values()))
        return FlushAttempt(False, failures=result.failed.get(tier))

    def holds(self, tier: TierName, step: int, ranks: set[int]) -> bool:
        """See :meth:`TierRound.holds`."""
        return self.rounds.holds(tier, step, ranks)
