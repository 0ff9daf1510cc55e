"""Where one durable tier stands for the current incarnation, and which RAM step it takes next.

A tier's progress is keyed on **its own committed global steps of the current incarnation's
lineage**: steps with a verifying commit record (``commit.json``) whose incarnation is
live (:class:`strata.format.incarnation.Lineage`). A stale or foreign step (another world size,
another run of the same job id, a superseded replay) never sets the interval, never blocks a
promotion and never counts as newest for retention.

Choosing the step (:func:`choose_step`), among the RAM steps every local rank holds:

1. *eligible*: newer than the tier's newest committed step, due by the interval policy, and not
   given up for this tier (a shard failed ``max_attempts`` times: an ENOSPC burst);
2. the newest *aligned* eligible step (``EveryNSteps``: a multiple of n, so every pod's sidecar
   promotes the same step), unless a step this sidecar already placed is still waiting for other
   nodes' shards and is newer;
3. else a step already placed here and still in RAM (wait for the other nodes);
4. else the newest eligible step: the aligned one left RAM before the sidecar saw it (fast
   saves), or it was given up (the tier was full); the next eligible step is promoted at once
   instead of waiting a whole interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.format.commit import StepCommit
from strata.format.incarnation import Lineage
from strata.sidecar.promotion.policies import IntervalPolicy


@dataclass
class TierProgress:
    """Mutable bookkeeping of one durable tier (guarded by the engine's tier lock)."""

    initialised: bool = False
    incarnation: str | None = None
    """The incarnation the committed steps below were judged for."""
    lineage: Lineage = field(default_factory=lambda: Lineage([]))
    committed: dict[int, StepCommit] = field(default_factory=dict)
    """Live committed steps of the tier (global commit records)."""
    dead: dict[int, StepCommit] = field(default_factory=dict)
    """Committed steps of the tier that are not live in ``lineage`` (retention's collection
    judges which of them are superseded)."""
    last_step: int | None = None
    """Newest live committed step: where the interval starts."""
    last_time: float | None = None
    """When this engine last placed shards in the tier (engine clock)."""
    last_maintenance: float | None = None
    first_seen: dict[int, float] = field(default_factory=dict)
    behind: str | None = None
    """A newer incarnation than this node's current one has a record in the tier (its id):
    this node's RAM is behind the job (its trainer has not restored yet, or the job moved
    elsewhere). Nothing is promoted, replaced or deleted in the tier until it catches up."""
    placed: dict[int, set[int]] = field(default_factory=dict)
    """step -> local ranks this engine has committed in the tier, step not yet globally committed."""

    def set_committed(self, committed: dict[int, StepCommit]) -> None:
        self.committed = committed
        newest = max(committed, default=None)
        self.last_step = newest
        if newest is not None:
            for s in [s for s in self.placed if s <= newest]:
                del self.placed[s]


def choose_step(
    progress: TierProgress,
    interval: IntervalPolicy,
    ram_steps: list[int],
    now: float,
    since: float,
    given_up: set[int],
) -> int | None:
    """The RAM step to promote to the tier now (see the module docstring), or None.

    ``ram_steps``: steps every local rank holds in RAM (current incarnation); ``now``/``since``:
    engine clock, ``since`` the last placement (or the engine's start); ``given_up``: steps whose
    shards this tier refused ``max_attempts`` times."""
    last = progress.last_step
    eligible = [
        s
        for s in ram_steps
        if s not in given_up and (last is None or s > last) and interval.due(s, last, now, since)
    ]
    waiting = [s for s in progress.placed if s in ram_steps and (last is None or s > last)]
    aligned = interval.candidate(eligible) if eligible else None
    if aligned is not None and (not waiting or aligned > max(waiting)):
        return aligned
    if waiting:
        return max(waiting)
    return max(eligible, default=None)
