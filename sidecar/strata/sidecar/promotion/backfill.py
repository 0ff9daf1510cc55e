"""Back-fill: a live step of an earlier incarnation that a faster durable tier holds but a slower
one lacks is copied there by whichever sidecar runs now.

Why: a sidecar promotes its own RAM steps only. When a node dies after its shards of step S
reached the PVC but before they reached GCS, the replacement pod's sidecar never had S in RAM,
so without back-fill S would never reach GCS although it is live (the job may even have resumed
from it): losing the PVC would then lose S for good.

Which steps (:func:`backfill_steps`, pure): steps *eligible* in the source tier
(:mod:`strata.tiers.eligible`: committed and live), written by an incarnation other than the
current one (the current incarnation's own steps follow the destination's interval), not
archive-only, not eligible in the destination already (never re-uploaded), and that retention
would keep in the destination: among the newest ``keep`` of the destination's eligible steps
together with the candidates. So back-fill costs at most ``keep`` steps per destination, once.

Who copies what: each sidecar copies the shards of its local ranks (below the step's world
size); ranks that no sidecar of the current world serves (the step was written at a larger world
size) are copied by the step's designated commit writer
(:func:`strata.sidecar.promotion.committer.commit_writer_rank`). The commit record in the
destination is then written like any other (designated writer, takeover), for the step's own
incarnation, with that incarnation's records copied first.

:class:`Backfill` does it for one sidecar at maintenance; failures are retried in later rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from strata.config import TierName
from strata.errors import TierError
from strata.format.commit import StepCommit
from strata.sidecar.promotion.committer import Committer
from strata.sidecar.promotion.copy import ShardCopier
from strata.sidecar.promotion.events import PromotionEvent, RoundResult
from strata.sidecar.promotion.policies import RetentionPolicy
from strata.sidecar.promotion.tier_views import TierViews
from strata.sidecar.promotion.world import chain

log = logging.getLogger("strata.promotion")


def backfill_steps(
    source: Mapping[int, StepCommit],
    destination: Mapping[int, StepCommit],
    retention: RetentionPolicy,
    current: str | None,
) -> list[int]:
    """The steps to back-fill into the destination, newest first (see the module docstring).

    ``source`` / ``destination``: eligible steps (step -> commit record) of the faster tier and
    of the destination; ``retention``: the destination's; ``current``: the current incarnation
    (None: unknown, nothing is back-filled)."""
    if current is None:
        return []
    candidates = {
        s
        for s, c in source.items()
        if s not in destination and c.incarnation != current and not c.archive_only
    }
    if not candidates:
        return []
    dropped = set(retention.to_delete(set(destination) | candidates))
    return sorted(candidates - dropped, reverse=True)


class Backfill:
    """Back-fills the durable tiers of ``views`` (fastest first; their live committed steps,
    judged by the current snapshot of this node's incarnation) for one sidecar.

    ``copier``: copies a shard; ``committer``: settles the back-filled steps' commit records;
    ``retention``: each tier's retention policy (what it would keep); ``clock``: monotonic
    seconds; ``emit``: "backfilled" and "committed" events. Called under the destination tier's
    lock.
    """

    def __init__(
        self,
        views: TierViews,
        copier: ShardCopier,
        committer: Committer,
        retention: Mapping[TierName, RetentionPolicy],
        *,
        clock: Callable[[], float],
        emit: Callable[[PromotionEvent], None],
    ) -> None:
        self.views = views
        self.copier = copier
        self.committer = committer
        self.retention = retention
        self._clock = clock
        self._emit = emit

    def run(self, name: TierName, ranks: set[int], result: RoundResult) -> None:
        """Copy into ``name`` the shards of ``ranks`` (the local ranks) of the steps
        :func:`backfill_steps` picks from the first faster tier that has any; what was
        committed goes to ``result``."""
        progress = self.views.progress
        p = progress[name]
        world = self.views.world()
        if p.behind is not None or world.incarnation is None or not ranks:
            return
        for src_name in self.views.durable:
            if src_name == name:
                return
            src = progress[src_name]
            if not src.initialised or src.behind is not None:
                continue
            steps = backfill_steps(
                src.committed, p.committed, self.retention[name], world.incarnation
            )
            for step in steps:
                self._step(name, src_name, src.committed[step], ranks, result)
            if steps:
                return

    def _step(
        self,
        name: TierName,
        src_name: TierName,
        commit: StepCommit,
        ranks: set[int],
        result: RoundResult,
    ) -> None:
        step, w = commit.step, commit.world_size
        world = self.views.world()
        mine = {r for r in ranks if r < w}
        if self.committer.designated(step, world, ranks):
            mine |= set(range(min(world.world_size or w, w), w))  # ranks no sidecar here serves
        source = self.views.durable[src_name]
        copied: list[int] = []
        nbytes = 0
        started = self._clock()
        for rank in sorted(mine):
            try:
                m = source.get_manifest(self.views.job_id, step, rank)
            except TierError as exc:
                log.info("back-fill of rank %d of step %d skipped: %s", rank, step, exc)
                continue
            if m.incarnation != commit.incarnation or m.refs is not None or m.components:
                # Only a full copy of the committed shard is a source (an incremental copy
                # needs its base; that case stays on the source tier).
                continue
            self.views.drop_superseded(name, step, [rank])
            ok, n, msg = self.copier.promote_shard(name, step, rank, m)
            if not ok:
                result.failed.setdefault(name, []).append(msg)
                continue
            if n:
                copied.append(rank)
                nbytes += n
        if copied:
            seconds = self._clock() - started
            log.info(
                "back-filled ranks %s of step %d (incarnation %s) from %s to %s (%d bytes)",
                copied,
                step,
                commit.incarnation,
                src_name,
                name,
                nbytes,
                extra={"event": "backfilled", "tier": name, "step": step, "ranks": copied},
            )
            self._emit(PromotionEvent("backfilled", name, step, tuple(copied), nbytes, seconds))
        records = chain(self.views.progress[src_name].lineage.records, commit.incarnation)
        done = self.committer.settle(
            name, step, world, ranks=ranks, incarnation=commit.incarnation, records=records
        )
        if done is not None:
            result.committed.setdefault(name, step)
            self._emit(PromotionEvent("committed", name, step, tuple(range(done.world_size))))
