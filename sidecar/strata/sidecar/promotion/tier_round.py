"""One durable tier's part of a promotion round: :class:`TierRound` (copy, verify, commit).

For a tier, given the RAM steps every local rank holds: pick the step to promote
(:func:`~strata.sidecar.promotion.progress.choose_step`: the tier's own committed steps and its
interval), copy every local shard of it (:class:`~strata.sidecar.promotion.copy.ShardCopier`,
bounded concurrency; a superseded incarnation's shard of that step is removed first), then
settle the step's global commit record (:class:`~strata.sidecar.promotion.committer.Committer`).
A step whose local shards are already placed only waits for its record. Steps newer than the
tier's newest commit whose record is missing are settled at maintenance
(:meth:`TierRound.commit_missing`). Failures are returned (``RoundResult.failed``), never raised;
a tier out of space is judged by :class:`~strata.sidecar.promotion.capacity.CapacityWatch`.
Called under the tier's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from strata.config import TierName
from strata.errors import TierError
from strata.format.manifest import Manifest
from strata.sidecar.promotion.capacity import CapacityWatch
from strata.sidecar.promotion.committer import Committer
from strata.sidecar.promotion.copy import ShardCopier
from strata.sidecar.promotion.events import PromotionEvent, RoundResult
from strata.sidecar.promotion.policies import IntervalPolicy
from strata.sidecar.promotion.progress import choose_step
from strata.sidecar.promotion.tier_views import TierViews

log = logging.getLogger("strata.promotion")


class TierRound:
    """Promotes the local shards of one step at a time to the durable tiers of ``views``
    (their live committed steps: each tier's ``progress`` is updated here).

    ``intervals``: each tier's interval policy; ``copier``: copies a shard; ``capacity``: judges
    a tier out of space; ``committer``: settles commit records; ``clock``: monotonic seconds,
    ``started`` on it (the first interval runs from there); ``max_workers``: shards copied
    concurrently; ``emit``: "promoted" and "committed" events.
    """

    def __init__(
        self,
        views: TierViews,
        intervals: Mapping[TierName, IntervalPolicy],
        copier: ShardCopier,
        capacity: CapacityWatch,
        committer: Committer,
        *,
        clock: Callable[[], float],
        started: float,
        max_workers: int,
        emit: Callable[[PromotionEvent], None],
    ) -> None:
        self.views = views
        self.intervals = intervals
        self.copier = copier
        self.capacity = capacity
        self.committer = committer
        self._clock = clock
        self.started = started
        self.max_workers = max(1, max_workers)
        self._emit = emit

    def choose(self, name: TierName, ram_steps: list[int]) -> int | None:
        """The RAM step (of ``ram_steps``, ascending) to promote to ``name`` now, or None
        (:func:`~strata.sidecar.promotion.progress.choose_step`)."""
        p = self.views.progress[name]
        return choose_step(
            p,
            self.intervals[name],
            ram_steps,
            self._clock(),
            p.last_time or self.started,
            self.copier.given_up(name),
        )

    def promote_if_due(
        self,
        name: TierName,
        step: int,
        manifests: dict[int, Manifest],
        force: bool,
        result: RoundResult,
    ) -> None:
        """Place the shards ``manifests`` (rank -> RAM manifest) of ``step`` in ``name`` when
        its interval is due (``force``: regardless), then settle the step's commit record."""
        progress = self.views.progress[name]
        if progress.last_step is not None and step <= progress.last_step:
            return
        waiting = step in progress.placed and set(manifests) <= progress.placed[step]
        due = (
            force
            or waiting
            or self.intervals[name].due(
                step, progress.last_step, self._clock(), progress.last_time or self.started
            )
        )
        if not due:
            return
        if not waiting:
            failures = self._promote_step(name, step, manifests)
            if failures:
                result.failed[name] = failures
                return
            result.promoted[name] = step
        self.commit(name, step, result)

    def commit(self, name: TierName, step: int, result: RoundResult) -> None:
        """Learn or write the step's global commit record in the tier: its designated writer
        writes it once every rank's shard of the current incarnation is there, the others read
        it (or take over after a timeout); :mod:`strata.sidecar.promotion.committer`."""
        commit = self.committer.settle(name, step, self.views.world())
        if commit is None:
            return
        progress = self.views.progress[name]
        progress.set_committed({**progress.committed, step: commit})
        result.committed[name] = step
        self._emit(PromotionEvent("committed", name, step, tuple(range(commit.world_size))))

    def commit_missing(self, name: TierName, result: RoundResult) -> None:
        """Commit steps newer than the tier's newest commit whose record is missing: steps
        this sidecar placed shards of (their designated writer may have died: takeover) and
        steps it is the designated writer of (its RAM may have lost them). One listing of the
        step names, never of the shards (:mod:`strata.sidecar.promotion.committer`)."""
        if not self.views.refresh(name):
            return
        p = self.views.progress[name]
        try:
            steps = self.views.durable[name].step_numbers(self.views.job_id)
        except TierError:
            return
        for step in steps:
            if step in p.committed or (p.last_step is not None and step <= p.last_step):
                continue
            if step in p.placed or self.committer.designated(step, self.views.world()):
                self.commit(name, step, result)

    def holds(self, name: TierName, step: int, ranks: set[int]) -> bool:
        """``step`` (or a newer one) is committed in ``name`` as far as this sidecar knows, or
        it placed the shards of every rank of ``ranks`` there (their commit record may still
        wait for other nodes)."""
        progress = self.views.progress[name]
        if progress.last_step is not None and step <= progress.last_step:
            return True
        placed = progress.placed.get(step)
        return placed is not None and bool(ranks) and ranks <= placed

    def _promote_step(self, name: TierName, step: int, manifests: dict[int, Manifest]) -> list[str]:
        """Copy every local shard of ``step`` into tier ``name``; returns failure messages.

        A shard of a superseded incarnation already there for a rank (a replay rewrites the
        step) is removed first: it can never be restored, and GCS never overwrites an object."""
        started = self._clock()
        ranks = sorted(manifests)
        self.views.drop_superseded(name, step, ranks)
        with ThreadPoolExecutor(
            max_workers=min(self.max_workers, len(ranks)), thread_name_prefix=f"strata-{name}"
        ) as pool:
            outcomes = list(
                pool.map(lambda r: self.copier.promote_shard(name, step, r, manifests[r]), ranks)
            )
        failures = [msg for ok, _n, msg in outcomes if not ok]
        if failures:
            if self.copier.full.get(name) == step:
                self.capacity.check(name, step, manifests)
            return failures
        self.copier.full.pop(name, None)
        self.capacity.fits(name, step)
        nbytes = sum(n for _ok, n, _msg in outcomes)
        seconds = self._clock() - started
        progress = self.views.progress[name]
        progress.placed.setdefault(step, set()).update(ranks)
        progress.last_time = self._clock()
        log.info(
            "promoted step %d to %s (%d bytes, %.3fs)",
            step,
            name,
            nbytes,
            seconds,
            extra={
                "event": "promoted",
                "tier": name,
                "step": step,
                "bytes": nbytes,
                "ranks": ranks,
            },
        )
        self._emit(PromotionEvent("promoted", name, step, tuple(ranks), nbytes, seconds))
        return []
