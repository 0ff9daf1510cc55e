"""When a tier is due and which steps a tier keeps: small policy classes (Orbax style).

Interval policies (when a tier is due) are :mod:`strata.intervals`, shared with the trainer's
saves; they are re-exported here.

Retention policies pick which *complete* steps of a tier to delete (``LatestN``). They never
return the newest complete step; incomplete steps are never theirs to delete (the promotion
engine garbage-collects those separately, after a grace period).

Every class validates its options when constructed and raises :class:`PolicyError` (a
``ValueError``) whose message names the option and the conflict.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from strata.config import Interval, StrataConfig, TierName
from strata.errors import PolicyError
from strata.intervals import (
    AnyOf,
    EveryNSeconds,
    EveryNSteps,
    EveryStep,
    IntervalPolicy,
    check_int,
    interval_policy,
)

__all__ = [
    "AnyOf",
    "EveryNSeconds",
    "EveryNSteps",
    "EveryStep",
    "IntervalPolicy",
    "LatestN",
    "RetentionPolicy",
    "TierPolicy",
    "interval_policy",
    "tier_policies",
]


@runtime_checkable
class RetentionPolicy(Protocol):
    """Picks the complete steps to delete from a tier."""

    @property
    def keep(self) -> int | None:
        """How many complete steps it keeps (None: not a count; e.g. a rule by age)."""

    def to_delete(self, complete_steps: Iterable[int]) -> list[int]:
        """Complete steps (any order) -> the ones to delete, ascending; never the newest one."""


@dataclass(frozen=True)
class LatestN:
    """Keep the newest ``n`` complete steps of a tier; older complete steps are deleted.

    ``n`` >= 1: the newest complete step is never deleted before a newer one is complete
    (docs/architecture.md "Commit protocol"), so ``keep: 0`` is refused rather than silently
    raised to 1.
    """

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, int) and not isinstance(self.n, bool) and self.n == 0:
            raise PolicyError(
                "LatestN.n (keep) = 0 conflicts with the rule that the newest complete step is "
                "never deleted; use keep >= 1"
            )
        check_int("LatestN.n (keep)", self.n, 1)

    @property
    def keep(self) -> int:
        return self.n

    def to_delete(self, complete_steps: Iterable[int]) -> list[int]:
        steps = sorted(set(complete_steps))
        return steps[: max(0, len(steps) - self.n)]


@dataclass(frozen=True)
class TierPolicy:
    """The interval and retention of one tier."""

    tier: TierName
    interval: IntervalPolicy
    retention: RetentionPolicy


def tier_policies(config: StrataConfig) -> dict[TierName, TierPolicy]:
    """Policies of every configured tier, validated against each other.

    Raises :class:`PolicyError` when a durable tier's step interval cannot be honoured because
    the RAM tier does not hold the steps it asks for: e.g. ``pvc.every.steps=15`` with
    ``ram.every.steps=10`` would silently become "every 20"; the message names both settings.
    """
    out: dict[TierName, TierPolicy] = {
        "ram": TierPolicy("ram", interval_policy(config.ram.every), LatestN(config.ram.keep))
    }
    ram_steps = config.ram.every.steps
    durable: Sequence[tuple[TierName, Interval | None, int]] = (
        ("pvc", config.pvc.every if config.pvc else None, config.pvc.keep if config.pvc else 1),
        ("gcs", config.gcs.every if config.gcs else None, config.gcs.keep if config.gcs else 1),
    )
    for name, every, keep in durable:
        if every is None:
            continue
        if ram_steps is not None and every.steps is not None and every.steps % ram_steps != 0:
            raise PolicyError(
                f"{name}.every.steps={every.steps} is not a multiple of ram.every.steps={ram_steps}: "
                f"the {name} tier can only receive steps the RAM tier saved; make {name}.every.steps "
                f"a multiple of {ram_steps}"
            )
        out[name] = TierPolicy(name, interval_policy(every), LatestN(keep))
    return out
