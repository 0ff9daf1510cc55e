"""The Events the operator posts, as values: what a role decides to say about an object.

Rule: data only (posting is :func:`strata_operator.cluster.post_event`'s); the reasons are the
``EVENT_*`` constants of :mod:`strata_operator.constants`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventSpec:
    """A core/v1 Event to post: ``type`` (Normal | Warning), CamelCase ``reason``, ``message``
    (at most 1,024 characters are posted)."""

    type: str
    reason: str
    message: str
    key: str = ""
    """Identity of what the event is about (job, pod, rank, time): a re-sent report repeats it."""
