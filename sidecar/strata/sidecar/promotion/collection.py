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
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from strata.format.commit import StepCommit
from strata.format.incarnation import Lineage
from strata.format.manifest import Manifest
from strata.tiers.eligible import superseded


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
