"""The Events the operator posts, as values: what a role decides to say about an object.

Rule: data only (posting, with repeats aggregated into a series, is
:class:`strata_operator.cluster.EventRecorder`'s); the reasons are the ``EVENT_*`` constants and
the actions the ``ACTION_*`` constants of :mod:`strata_operator.constants`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventSpec:
    """An Event to post: ``type`` (Normal | Warning), CamelCase ``reason``, ``message`` (at most
    1,024 bytes are posted)."""

    type: str
    reason: str
    message: str
    key: str = ""
    """Identity of what the event is about (job, pod, rank, time): a re-sent report repeats it."""
    action: str = ""
    """What the operator did or failed to do (CamelCase, e.g. ``Reconcile``); empty: the posting
    role's own action."""
