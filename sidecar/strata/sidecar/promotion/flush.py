"""The SIGTERM flush (C-14): before the pod dies, promote the newest committed RAM step to the
fastest durable tier, within a deadline, unless a durable tier already holds it or a newer one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.config import TierName
from strata.sidecar.promotion.events import RoundResult

if TYPE_CHECKING:
    from strata.sidecar.promotion.round import PromotionEngine

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


def flush(engine: PromotionEngine, deadline: float) -> FlushResult:
    """See :meth:`PromotionEngine.flush`."""
    engine.stop_interval_promotion()
    tier = engine.fastest_durable()
    if tier is None:
        return FlushResult(None, None, None, ok=True, message="no durable tier configured")
    lock = engine.tier_lock(tier)
    if not lock.acquire(timeout=max(0.0, deadline - engine._clock())):
        return FlushResult(
            tier, None, None, ok=False, message=f"deadline passed waiting for the {tier} tier"
        )
    try:
        listing = engine.ram_steps()
        ranks = engine.local_ranks(listing)
        engine.init_tier(tier, ranks)
        step = max(engine.ram_steps_of(ranks, listing), default=None)
        durable_step = engine.newest_durable_step(tier, ranks)
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
            for rank in ranks:
                engine.copier.reset(tier, step, rank)
            manifests = engine.ram_manifests(step, ranks, seal=True)
            if manifests is not None:
                result = RoundResult(ram_step=step)
                engine.promote_if_due(tier, step, manifests, True, result)
                if result.promoted.get(tier) == step:
                    nbytes = sum(m.data_nbytes for m in manifests.values())
                    return FlushResult(
                        tier, step, durable_step, ok=True, message="promoted", nbytes=nbytes
                    )
                if engine.holds(tier, step, ranks):
                    # An earlier pass placed these shards (and this one may have just written
                    # the step's commit record): nothing is left to copy.
                    return FlushResult(
                        tier, step, step, ok=True, message="local shards already on the tier"
                    )
                failures = result.failed.get(tier, failures)
            remaining = deadline - engine._clock()
            if remaining <= FIRST_RETRY_SECONDS:
                return FlushResult(tier, step, durable_step, ok=False, message="; ".join(failures))
            time.sleep(min(delay, remaining - FIRST_RETRY_SECONDS))
            delay = min(delay * 2, MAX_RETRY_SECONDS)
    finally:
        lock.release()
