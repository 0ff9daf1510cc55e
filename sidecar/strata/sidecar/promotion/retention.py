"""Retention and garbage collection of one durable tier, for the ranks one sidecar serves.

Per durable tier: complete steps beyond ``keep`` lose this sidecar's ranks
(:func:`plan_retention`, a pure function); incomplete steps older than the newest complete step
lose this sidecar's uncommitted data and the shards it wrote itself (writer id) after
``gc_grace_seconds``; then the tier collects leftovers outside the layout
(:meth:`strata.tiers.base.Tier.gc_incomplete`). A step that a kept step references as its base
(an incremental copy, :mod:`strata.format.incremental`) is never deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from strata.errors import ShardUnavailable, TierError
from strata.sidecar.promotion.events import PromotionEvent
from strata.sidecar.promotion.policies import RetentionPolicy
from strata.tiers.base import StepListing, Tier
from strata.tiers.references import referenced_bases

log = logging.getLogger("strata.promotion")


@dataclass(frozen=True)
class RetentionPlan:
    """Steps of one tier to delete: ``prune`` (complete, beyond keep) and ``gc`` (incomplete,
    older than the newest complete step, past the grace period). ``waiting``: incomplete old
    steps still within their grace period."""

    prune: tuple[int, ...] = ()
    gc: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()


def plan_retention(
    listings: Mapping[int, StepListing],
    retention: RetentionPolicy,
    *,
    now: float,
    grace_seconds: float,
    first_seen: Mapping[int, float] | None = None,
    complete: Collection[int] | None = None,
) -> RetentionPlan:
    """Which steps of a tier to delete (pure).

    Rules (docs/architecture.md "Commit protocol"): only complete steps are pruned, by
    ``retention``, which never returns the newest complete step; nothing is deleted while no
    step is complete; incomplete steps newer than the newest complete step are never touched (a
    save or a promotion may be in flight); an incomplete step older than it is garbage once its
    newest file is older than ``grace_seconds`` (``now`` and ``mtime``: seconds since the epoch;
    a listing without ``mtime`` counts from ``first_seen[step]``, when this engine first saw it).
    ``complete``: the steps that count as complete (the tier's live committed global
    steps); default: every listing whose ranks are all there.
    """
    done = sorted(
        (s for s in complete if s in listings)
        if complete is not None
        else (s for s, listing in listings.items() if listing.complete)
    )
    if not done:
        return RetentionPlan()
    newest = done[-1]
    done_set = set(done)
    prune = tuple(s for s in retention.to_delete(done) if s != newest)
    gc: list[int] = []
    waiting: list[int] = []
    for step in sorted(listings):
        listing = listings[step]
        if step in done_set or step >= newest:
            continue
        since = listing.mtime
        if since is None:
            since = (first_seen or {}).get(step, now)
        (gc if now - since > grace_seconds else waiting).append(step)
    return RetentionPlan(prune=prune, gc=tuple(gc), waiting=tuple(waiting))


class Retention:
    """Applies :func:`plan_retention` to a tier for the ranks of one sidecar.

    ``wrote(writer_id)``: whether a manifest's writer is this pod (GC deletes only its own
    committed shards of incomplete steps). ``grace_seconds``: ``StrataConfig.gc_grace_seconds``.
    """

    def __init__(
        self,
        job_id: str,
        *,
        grace_seconds: float,
        wrote: Callable[[str], bool],
        emit: Callable[[PromotionEvent], None],
    ) -> None:
        self.job_id = job_id
        self.grace_seconds = grace_seconds
        self.wrote = wrote
        self.emit = emit
        self._done: set[tuple[str, int]] = set()
        """(tier, step) whose ranks of this sidecar are deleted (scoped maintenance)."""

    def maintain(
        self,
        tier: Tier,
        ranks: set[int],
        retention: RetentionPolicy,
        *,
        now: float,
        first_seen: dict[int, float],
        complete: Collection[int] | None = None,
    ) -> list[int]:
        """Retention and GC of ``tier`` for ``ranks``; returns the steps touched.

        ``now``: seconds since the epoch; ``first_seen``: step -> when it was first listed
        (updated here: new steps added, vanished ones dropped). Never raises a TierError.
        """
        if not ranks:
            return []
        try:
            listings = (
                self._scoped_listings(tier, ranks)
                if complete is not None
                else tier.list_steps(self.job_id)
            )
        except TierError as exc:
            log.warning("retention on %s skipped: %s", tier.name, exc)
            return []
        for s in listings:
            first_seen.setdefault(s, now)
        plan = plan_retention(
            listings,
            retention,
            now=now,
            grace_seconds=self.grace_seconds,
            first_seen=first_seen,
            complete=complete,
        )
        touched: list[int] = []
        # A base step lives as long as a step that is kept references it.
        pruned = set(plan.prune) | set(plan.gc)
        kept = [s for s, lst in listings.items() if s not in pruned and lst.committed_ranks]
        needed = referenced_bases(tier, self.job_id, kept, ranks)
        plan = RetentionPlan(
            prune=tuple(s for s in plan.prune if s not in needed),
            gc=tuple(s for s in plan.gc if s not in needed),
            waiting=plan.waiting,
        )
        for step in plan.prune:
            listing = listings[step]
            mine = frozenset(ranks & (listing.committed_ranks | listing.partial_ranks))
            if mine and self._delete(tier, step, mine, "retention"):
                touched.append(step)
        for step in plan.gc:
            mine = self._gc_ranks(tier, listings[step], ranks)
            if mine and self._delete(tier, step, mine, "gc"):
                touched.append(step)
        if complete is None:
            # Scoped (complete given): the rank-scoped deletes above also remove the leftovers
            # of interrupted uploads of these ranks, so the job-wide scan is not needed.
            try:
                tier.gc_incomplete(self.job_id, self.grace_seconds)
            except TierError as exc:
                log.warning("GC of uncommitted objects on %s failed: %s", tier.name, exc)
        else:
            self._done.update((tier.name, s) for s in touched)
            self._done &= {(tier.name, s) for s in listings} | {
                k for k in self._done if k[0] != tier.name
            }
        for step in list(first_seen):
            if step not in listings:
                del first_seen[step]
        return touched

    def _scoped_listings(self, tier: Tier, ranks: set[int]) -> dict[int, StepListing]:
        """Every step of the tier (one listing of the step names, never of their shards), each
        standing for this sidecar's ranks only: retention deletes just those ranks, so it need
        not know the others (cost O(own ranks), not O(world size)). Steps whose ranks this
        sidecar already deleted are left out until they vanish. ``mtime`` is unknown: the GC
        grace period counts from when this engine first saw the step."""
        mine = frozenset(ranks)
        return {
            s: StepListing(step=s, committed_ranks=mine, partial_ranks=mine)
            for s in tier.step_numbers(self.job_id)
            if (tier.name, s) not in self._done
        }

    def _gc_ranks(self, tier: Tier, listing: StepListing, ranks: set[int]) -> frozenset[int]:
        """Local ranks of an incomplete step that this writer may delete: uncommitted data, and
        committed shards whose manifest names this writer."""
        out = set(ranks & listing.partial_ranks - listing.committed_ranks)
        for rank in ranks & listing.committed_ranks:
            try:
                if self.wrote(tier.get_manifest(self.job_id, listing.step, rank).writer_id):
                    out.add(rank)
            except ShardUnavailable:
                if rank in listing.partial_ranks:  # scoped: no manifest, so uncommitted
                    out.add(rank)
                continue
        return frozenset(out)

    def _delete(
        self, tier: Tier, step: int, ranks: frozenset[int], reason: Literal["retention", "gc"]
    ) -> bool:
        try:
            tier.delete_step(self.job_id, step, ranks)
        except TierError as exc:
            log.warning("%s of step %d on %s failed: %s", reason, step, tier.name, exc)
            return False
        log.info(
            "%s deleted ranks %s of step %d from %s",
            reason,
            sorted(ranks),
            step,
            tier.name,
            extra={"event": reason, "tier": tier.name, "step": step},
        )
        self.emit(PromotionEvent(reason, tier.name, step, tuple(sorted(ranks))))
        return True
