"""Restore: which step every rank loads (pure planning) and getting one shard into RAM (staging).

Rule: :mod:`~strata.restore.plan` is pure (no I/O, no tiers); :mod:`~strata.restore.inventory`
and :mod:`~strata.restore.staging` talk to tiers only through the :class:`strata.tiers.base.Tier`
contract. This package never imports the client nor the sidecar; both use it (the trainer
without a sidecar through :class:`strata.client.LocalStager`, the sidecar through its local API).
"""

from strata.errors import StageError
from strata.restore.inventory import collect_inventory
from strata.restore.plan import (
    RankInventory,
    RestorePlan,
    plan_restore,
    restorable_steps,
    shard_sources,
    skipped_partial_steps,
)
from strata.restore.staging import StageResult, stage_into_ram, stage_shard

__all__ = [
    "RankInventory",
    "RestorePlan",
    "StageError",
    "StageResult",
    "collect_inventory",
    "plan_restore",
    "restorable_steps",
    "shard_sources",
    "skipped_partial_steps",
    "stage_into_ram",
    "stage_shard",
]
