"""When a tier is due: the interval rule of the trainer's saves and of the sidecar's promotions.

One rule for both sides (Orbax-style policy classes). An :class:`IntervalPolicy` answers "is
``step`` due now?" given the last step written and when. A step bound is *aligned*:
``EveryNSteps(50)`` is due for the first step at or past the next multiple of 50 after the last
one written (50, 100, 150, ...; if the sidecar only sees 60 because the RAM tier already moved
past 50, 60 is promoted and the next one is due at 100). This keeps the durable tiers on the
same steps (GCS every 100 finds the step on the PVC, which saved every 50) even when the sidecar
misses a RAM step. A seconds bound is measured from the last write (or from the start when the
tier has never been written). A tier with both bounds is due when either has elapsed
(docs/architecture.md "Promotion and retention"; :class:`strata.config.Interval`).

The trainer sees every step go by, so its question is :func:`due_now` (the last step "seen" is
the one before): with a step bound it saves exactly the multiples of ``n``. The sidecar asks
:meth:`IntervalPolicy.due` with the last step it promoted.

Every class validates its options when constructed and raises
:class:`strata.errors.PolicyError` (a ``ValueError``) whose message names the option and the
conflict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from strata.config import Interval
from strata.errors import PolicyError


@runtime_checkable
class IntervalPolicy(Protocol):
    """Decides whether a tier is due to receive ``step``."""

    def due(self, step: int, last_step: int | None, now: float, last_time: float | None) -> bool:
        """``last_step``/``last_time``: the tier's newest promoted step and when (seconds, any
        monotonic clock consistent with ``now``); None when the tier has none yet."""

    def candidate(self, steps: Iterable[int]) -> int | None:
        """Of the steps RAM holds for every local rank, the one to promote (None: none fits)."""


def _newest(steps: Iterable[int]) -> int | None:
    return max(steps, default=None)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` when it is an int >= ``minimum``; :class:`PolicyError` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PolicyError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class EveryNSteps:
    """Due at the first step at or past the next multiple of ``n`` after the last promotion.

    With no previous promotion, due once ``step >= n`` (a job that saved step 0 does not
    promote it until step ``n``; step 0 is the untrained model).
    """

    n: int

    def __post_init__(self) -> None:
        check_int("EveryNSteps.n (every.steps)", self.n, 1)

    def due(self, step: int, last_step: int | None, now: float, last_time: float | None) -> bool:
        if last_step is None:
            return step >= self.n
        return step > last_step and step // self.n > last_step // self.n

    def candidate(self, steps: Iterable[int]) -> int | None:
        """The newest multiple of ``n``: every pod's sidecar then promotes the same steps, so a
        durable tier holds *complete* steps even when pods are at different steps when their
        sidecars look ("the newest step" would be 8 on one pod and 11 on another, and the tier
        would never hold all ranks of one step)."""
        return _newest(s for s in steps if s % self.n == 0)


@dataclass(frozen=True)
class EveryNSeconds:
    """Due when at least ``seconds`` have passed since the last promotion (or since start)."""

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, int | float):
            raise PolicyError(
                f"EveryNSeconds.seconds (every.seconds) must be a number, got {self.seconds!r}"
            )
        if not math.isfinite(self.seconds) or self.seconds <= 0:
            raise PolicyError(
                f"EveryNSeconds.seconds (every.seconds) must be a finite number > 0, got {self.seconds}"
            )

    def due(self, step: int, last_step: int | None, now: float, last_time: float | None) -> bool:
        if last_step is not None and step <= last_step:
            return False
        return last_time is None or now - last_time >= self.seconds

    def candidate(self, steps: Iterable[int]) -> int | None:
        return _newest(steps)


@dataclass(frozen=True)
class EveryStep:
    """Due for every step newer than the last promoted one (an Interval with no bound set)."""

    def due(self, step: int, last_step: int | None, now: float, last_time: float | None) -> bool:
        return last_step is None or step > last_step

    def candidate(self, steps: Iterable[int]) -> int | None:
        return _newest(steps)


@dataclass(frozen=True)
class AnyOf:
    """Due when any of ``policies`` is due (an Interval with both ``steps`` and ``seconds``)."""

    policies: tuple[IntervalPolicy, ...]

    def __post_init__(self) -> None:
        if not self.policies:
            raise PolicyError("AnyOf needs at least one policy; use EveryStep() for every step")
        if any(isinstance(p, EveryStep) for p in self.policies) and len(self.policies) > 1:
            raise PolicyError(
                "AnyOf(EveryStep(), ...) conflicts: EveryStep is always due, so the other bounds "
                "would never matter; use EveryStep() alone or drop it"
            )

    def due(self, step: int, last_step: int | None, now: float, last_time: float | None) -> bool:
        return any(p.due(step, last_step, now, last_time) for p in self.policies)

    def candidate(self, steps: Iterable[int]) -> int | None:
        # A time bound can make any step due: the newest one.
        return _newest(steps)


def interval_policy(interval: Interval) -> IntervalPolicy:
    """The policy of a config :class:`~strata.config.Interval` (due when any set bound elapsed)."""
    parts: list[IntervalPolicy] = []
    if interval.steps is not None:
        parts.append(EveryNSteps(interval.steps))
    if interval.seconds is not None:
        parts.append(EveryNSeconds(interval.seconds))
    if not parts:
        return EveryStep()
    return parts[0] if len(parts) == 1 else AnyOf(tuple(parts))


def due_now(policy: IntervalPolicy, step: int, now: float, last_time: float | None) -> bool:
    """Whether the trainer, reaching ``step``, is due to save it: ``policy.due`` with the step
    before as the last one seen (so ``EveryNSteps(n)`` is due at every multiple of ``n``,
    step 0 included), ``last_time`` the last save's time (None: none yet) on the clock of
    ``now`` (seconds)."""
    return policy.due(step, step - 1, now, last_time)
