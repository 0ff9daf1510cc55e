"""``metav1.Condition`` helpers for ``CheckpointPolicy.status.conditions`` (the JobSet way).

Condition types and reasons are constants in :mod:`strata_operator.constants` (CamelCase reasons,
machine-readable); the message is for humans and says what to fix. :func:`set_condition` keeps
``lastTransitionTime`` when the status did not change (Kubernetes API conventions: it is the time of
the last *transition*, not of the last check), so a reconcile that finds nothing new changes nothing
but ``observedGeneration``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from strata_operator.constants import CONDITION_REASONS

ConditionStatus = Literal["True", "False", "Unknown"]


def utcnow() -> datetime:
    """Now, UTC, whole seconds (metav1.Time has second precision)."""
    return datetime.now(UTC).replace(microsecond=0)


def format_time(value: datetime) -> str:
    """RFC 3339 as the apiserver writes it (``2026-01-02T03:04:05Z``)."""
    return value.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NewCondition:
    """A condition as a reconcile computes it (no transition time yet)."""

    type: str
    status: ConditionStatus
    reason: str
    message: str

    def __post_init__(self) -> None:
        if self.reason not in CONDITION_REASONS:
            raise ValueError(
                f"unknown condition reason {self.reason!r}; add it to constants.CONDITION_REASONS"
            )


def find(conditions: Iterable[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    """The condition of ``type_`` in a status' conditions list, or None."""
    for cond in conditions:
        if cond.get("type") == type_:
            return cond
    return None


def is_true(conditions: Iterable[Mapping[str, Any]], type_: str) -> bool:
    cond = find(conditions, type_)
    return cond is not None and cond.get("status") == "True"


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    new: NewCondition,
    *,
    generation: int | None,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """``conditions`` with ``new`` set (JSON dicts, camelCase), order kept, others untouched.

    ``lastTransitionTime`` is ``now`` when the type is new or its status changed, else the
    previous value; reason, message and observedGeneration always take the new values.
    """
    stamp = format_time(now or utcnow())
    out: list[dict[str, Any]] = []
    replaced = False
    for cond in conditions:
        if cond.get("type") != new.type:
            out.append(dict(cond))
            continue
        replaced = True
        keep = cond.get("status") == new.status and cond.get("lastTransitionTime")
        out.append(_render(new, generation, str(keep) if keep else stamp))
    if not replaced:
        out.append(_render(new, generation, stamp))
    return out


def _render(new: NewCondition, generation: int | None, transition: str) -> dict[str, Any]:
    cond: dict[str, Any] = {
        "type": new.type,
        "status": new.status,
        "reason": new.reason,
        "message": new.message,
        "lastTransitionTime": transition,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def set_conditions(
    conditions: Sequence[Mapping[str, Any]],
    new: Iterable[NewCondition],
    *,
    generation: int | None,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """:func:`set_condition` for several conditions with one ``now``."""
    moment = now or utcnow()
    out: list[dict[str, Any]] = [dict(c) for c in conditions]
    for cond in new:
        out = set_condition(out, cond, generation=generation, now=moment)
    return out
