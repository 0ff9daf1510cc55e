"""What the promotion engine reports: events (to metrics and operator reports) and round results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from strata.config import TierName

EventKind = Literal[
    "promoted",
    "backfilled",
    "failed",
    "gave_up",
    "checksum_mismatch",
    "retention",
    "gc",
    "sealed",
    "committed",
    "superseded",
    "too_small",
]
"""``backfilled``: shards of an earlier incarnation's live step copied into a slower tier
(:mod:`strata.sidecar.promotion.backfill`): bytes and time as ``promoted``, but an older step
than the tier may hold, and possibly ranks this pod does not serve; ``committed``: the step's global commit record was written in the tier (every rank's shard
of one incarnation is there); ``superseded``: a shard of a superseded incarnation was removed
so that the current incarnation's shard of that step could be committed."""


@dataclass(frozen=True)
class PromotionEvent:
    """Something the engine did; ``tier`` is where it happened (the corrupt copy's tier for
    ``checksum_mismatch``). ``nbytes``: bytes written; ``seconds``: wall time it took."""

    kind: EventKind
    tier: TierName
    step: int | None
    ranks: tuple[int, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    message: str = ""


@dataclass
class RoundResult:
    """Outcome of one :meth:`PromotionEngine.promote_once`."""

    ram_step: int | None = None
    """Newest step committed (and checksummed) in RAM for every local rank."""
    promoted: dict[TierName, int] = field(default_factory=dict)
    """Tier -> step whose local shards are now all committed there (promoted this round)."""
    failed: dict[TierName, list[str]] = field(default_factory=dict)
    deleted: dict[TierName, list[int]] = field(default_factory=dict)
    committed: dict[TierName, int] = field(default_factory=dict)
    """Tier -> step whose global commit record this engine wrote this round."""

    def add_deleted(self, tier: TierName, steps: list[int]) -> None:
        """Record ``steps`` deleted from ``tier`` (merged with those already recorded, ascending)."""
        if steps:
            self.deleted[tier] = sorted({*self.deleted.get(tier, []), *steps})
