"""The promotion engine: RAM -> PVC -> GCS for the ranks one sidecar serves, split by job.

- :mod:`~strata.sidecar.promotion.round`: :class:`PromotionEngine`, one promotion round (it
  composes the parts below; none of them imports it);
- :mod:`~strata.sidecar.promotion.ram_source`: the local ranks, their RAM steps and manifests;
- :mod:`~strata.sidecar.promotion.tier_views`: each durable tier's live committed steps;
- :mod:`~strata.sidecar.promotion.capacity`: a durable tier too small for keep + 1 steps;
- :mod:`~strata.sidecar.promotion.tier_round`: one tier's part of a round (copy, verify, commit);
- :mod:`~strata.sidecar.promotion.committer`: the global commit record's designated writer;
- :mod:`~strata.sidecar.promotion.copy`: copying one shard with verification and retries;
- :mod:`~strata.sidecar.promotion.maintenance`: a tier's maintenance, in order: missing commit
  records, back-fill, collection, retention;
- :mod:`~strata.sidecar.promotion.backfill`: live steps of earlier incarnations copied to a
  slower tier;
- :mod:`~strata.sidecar.promotion.collection`: superseded steps deleted by their collector;
- :mod:`~strata.sidecar.promotion.retention`: retention and GC of a durable tier;
- :mod:`~strata.sidecar.promotion.pruning`: the RAM tier's start-up pruning;
- :mod:`~strata.sidecar.promotion.flush`: the SIGTERM flush (over the parts, as a ``FlushTarget``);
- :mod:`~strata.sidecar.promotion.policies`: when a tier is due and what it keeps.

Rule: tiers are used only through the :class:`strata.tiers.base.Tier` contract (plus the RAM
tier's slot leases); nothing here knows a concrete durable tier.
"""

from strata.sidecar.promotion.events import EventKind, PromotionEvent, RoundResult
from strata.sidecar.promotion.flush import FlushResult
from strata.sidecar.promotion.retention import RetentionPlan, plan_retention
from strata.sidecar.promotion.round import DURABLE_TIERS, PromotionEngine

__all__ = [
    "DURABLE_TIERS",
    "EventKind",
    "FlushResult",
    "PromotionEngine",
    "PromotionEvent",
    "RetentionPlan",
    "RoundResult",
    "plan_retention",
]
