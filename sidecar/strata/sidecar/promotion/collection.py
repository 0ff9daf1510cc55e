"""Collection of superseded steps: steps no live lineage can reach are deleted from the durable
tiers, whoever wrote them.

Retention prunes complete steps of the live lineage beyond ``keep``, and garbage collection
removes a writer's own leftovers; neither touches a step that a superseded incarnation committed
(its writer's pod is gone, so its writer id is no one's). :func:`collectible_steps` (pure) picks
them, for one tier and one sidecar's view:

- the step is *superseded* (:func:`strata.tiers.eligible.superseded`): dead in the view's
  lineage and written by an incarnation older than the view's current one, so no fuller view
  (a sidecar that has seen more records) can find it live. A step whose commit record is missing
  counts when every committed shard of it is superseded (:func:`shards_superseded`);
- it is older than the tier's newest *eligible* step. The live lineage only promotes steps newer
  than its newest committed one, so below it no live writer can be rewriting the same step
  number (a replay): deleting it cannot race another sidecar's commit. A superseded step above
  the newest eligible step waits until the live run commits past it (or replaces it by its
  replay, :meth:`strata.sidecar.promotion.tier_views.TierViews.drop_superseded`). The newest
  eligible step itself is never collected;
- it is not eligible in another durable tier (a back-fill may be writing that step number here);
- this sidecar is its designated collector: the designated commit writer of the step at the
  current world size (:func:`strata.sidecar.promotion.committer.commit_writer_rank`), so each
  step is listed by one sidecar, and the duty rotates.

A node behind the job (the tier names a newer incarnation than its own) collects nothing (its
view is out of date). No live step can reference a collected step as the base of an incremental
copy: a base is an older step of the same incarnation (:func:`strata.format.incremental.plan_refs`),
so it is live as long as the step referencing it is. Deletion is the tier's ``delete_step``: the commit record first, then
manifests, then data (GCS: each object pinned to the generation listed, so an object rewritten
since is kept).

:class:`Collector` does it for one sidecar at maintenance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping

from strata.config import TierName
from strata.errors import TierError
from strata.format.commit import StepCommit
from strata.format.incarnation import Lineage
from strata.format.manifest import Manifest
from strata.sidecar.promotion.committer import Committer
from strata.sidecar.promotion.events import PromotionEvent, RoundResult
from strata.sidecar.promotion.tier_views import TierViews
from strata.tiers.base import Tier
from strata.tiers.eligible import superseded

log = logging.getLogger("strata.promotion")


def collectible_steps(
    lin: Lineage,
    dead: Mapping[int, StepCommit],
    newest_eligible: int | None,
    *,
    eligible_elsewhere: Collection[int] = (),
    designated: Callable[[int], bool] = lambda _s: True,
) -> list[int]:
    """Committed steps of one tier to collect, ascending (see the module docstring).

    ``dead``: the tier's committed steps that are not live (step -> commit record);
    ``newest_eligible``: the tier's newest eligible step (None: nothing is collected);
    ``eligible_elsewhere``: steps eligible in another durable tier; ``designated(step)``: this
    sidecar collects that step."""
    if newest_eligible is None:
        return []
    return sorted(
        s
        for s, c in dead.items()
        if s < newest_eligible
        and s not in eligible_elsewhere
        and designated(s)
        and superseded(lin, c.incarnation, s)
    )


def shards_superseded(lin: Lineage, step: int, manifests: Iterable[Manifest]) -> bool:
    """Every committed shard of a step without a commit record is superseded (at least one)."""
    incs = {m.incarnation for m in manifests}
    return bool(incs) and all(superseded(lin, inc, step) for inc in incs)


class Collector:
    """Collects the superseded steps of the durable tiers of ``views`` (their live and dead
    committed steps) that this sidecar is the designated collector of (``committer`` says);
    ``emit``: "superseded" events. Called under the tier's lock.
    """

    def __init__(
        self, views: TierViews, committer: Committer, emit: Callable[[PromotionEvent], None]
    ) -> None:
        self.views = views
        self.committer = committer
        self._emit = emit

    def collect(self, name: TierName, result: RoundResult) -> list[int]:
        """Delete the superseded steps of ``name`` this sidecar is the designated collector of
        (see the module docstring); returns the steps deleted (also in ``result.deleted``).
        A tier error is logged and the step left for a later round."""
        progress = self.views.progress
        p = progress[name]
        world = self.views.world()
        if p.behind is not None or world.incarnation is None or p.last_step is None:
            return []
        if not all(q.initialised for q in progress.values()):
            return []  # a tier whose view is unknown may hold a live copy being back-filled
        tier = self.views.durable[name]
        elsewhere = {s for n, q in progress.items() if n != name for s in q.committed}

        def designated(step: int) -> bool:
            return self.committer.designated(step, world)

        steps = collectible_steps(
            p.lineage, p.dead, p.last_step, eligible_elsewhere=elsewhere, designated=designated
        )
        try:
            for s in tier.step_numbers(self.views.job_id):
                if s >= p.last_step:
                    break
                if s in p.committed or s in p.dead or s in elsewhere or not designated(s):
                    continue
                if self._uncommitted_superseded(tier, s, p.lineage):
                    steps.append(s)
        except TierError as exc:
            log.info("collection on %s: %s", name, exc)
        deleted: list[int] = []
        for s in sorted(steps):
            c = p.dead.get(s)
            why = (
                p.lineage.why_dead(c.incarnation, s)
                if c is not None
                else f"every shard of step {s} belongs to a superseded incarnation"
            )
            try:
                tier.delete_step(self.views.job_id, s)
            except TierError as exc:
                log.warning("collection of superseded step %d on %s failed: %s", s, name, exc)
                continue
            deleted.append(s)
            log.info(
                "collected superseded step %d from %s: %s",
                s,
                name,
                why,
                extra={"event": "collected", "tier": name, "step": s},
            )
            self._emit(PromotionEvent("superseded", name, s, message=why))
        result.add_deleted(name, deleted)
        return deleted

    def _uncommitted_superseded(self, tier: Tier, step: int, lin: Lineage) -> bool:
        listing = tier.list_step(self.views.job_id, step)
        if listing is None or listing.has_commit:
            return False
        manifests = []
        for rank in sorted(listing.committed_ranks):
            try:
                manifests.append(tier.get_manifest(self.views.job_id, step, rank))
            except TierError:
                return False
        return shards_superseded(lin, step, manifests)
