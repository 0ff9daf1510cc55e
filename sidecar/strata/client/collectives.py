"""The restore's collective protocol: every collective a restore makes, one named phase each.

Every rank of a restore calls the same phases in the same order, and every branch between two
phases depends only on what the previous phase gathered (identical on every rank), never on a
rank's own outcome: a rank that left the protocol early would leave the others waiting in a
gather for ever. A rank's failure is therefore carried *into* the next phase and every rank
decides alike from the gathered outcomes (as torch DCP's ``state_dict_loader`` gathers each
rank's exception in its named ``plan`` / ``read`` phases). The order
(:class:`strata.client.restorer.Restorer` makes the calls)::

    reshard-candidate            once, unless resharding is off: every rank's reshard sources
                                 (steps of other world sizes it can read), so that every rank
                                 picks the same step (strata.restore.reshard.pick_reshard)
    per planning round (at most 64):
      inventory                  every rank's inventory, and rank 0's incarnation proposal
      -- the plan (pure, from the gathered inventories: the same on every rank) --
      reshard-check              when resharding: the per-rank values without a rule (every
                                 rank raises ReshardRefused alike before loading anything)
      reshard                    when resharding: every rank read its slices, or why not
      stage                      the tier that staged each rank's shard (None: it failed)
      load                       each rank's load failure (None: loaded) -> re-plan, raise, or on
      replicas                   sharded tensors: replicas from their owners (point to point)
      sharded                    whether every rank got its sharded tensors

The DCP reader (:mod:`strata.dcp`) has one phase of its own, ``dcp-step``: every rank's verdict
on a candidate step, so that all ranks load the same intact step.

Without torch.distributed (or at world size 1) each phase returns this rank's own value only.
:attr:`RestoreCollectives.trace` lists the phases this process took part in, in order (the
same list on every rank: tests compare them).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from strata.client.loader import load_failure, settle_load
from strata.client.sharded import ShardedLoad
from strata.errors import RestoreError
from strata.restore import RankInventory

log = logging.getLogger("strata.client")

Phase = Literal[
    "reshard-candidate",
    "inventory",
    "reshard-check",
    "reshard",
    "stage",
    "load",
    "replicas",
    "sharded",
    "dcp-step",
]


class RestoreCollectives:
    """The named phases of one rank (``rank`` of ``world_size``) over ``process_group``
    (None: the default group). See the module docstring for their order."""

    def __init__(self, rank: int, world_size: int, process_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.trace: list[Phase] = []
        """The phases this process took part in, in order (cleared by :meth:`begin`)."""

    @property
    def distributed(self) -> bool:
        """Whether the phases reach the other ranks (torch.distributed initialised, world > 1)."""
        return self._dist() is not None

    def begin(self) -> None:
        """A new restore: clear :attr:`trace`."""
        self.trace = []

    # -- the phases, in protocol order ------------------------------------------------------------

    def exchange_reshard_sources(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """``reshard-candidate``: every rank's reshard sources
        (:func:`strata.restore.reshard.reshard_sources`), by rank; every rank then picks the
        same step with :func:`strata.restore.reshard.pick_reshard`."""
        return self._all_gather("reshard-candidate", mine)

    def settle_reshard_check(
        self, blocking: list[str], error: str | None
    ) -> tuple[list[str], list[str]]:
        """``reshard-check``, before anything is loaded: (the per-rank values without a rule
        that any rank found, sorted; the ranks' failures to read the step's manifests). The
        same on every rank, so every rank refuses, falls back or loads alike."""
        found = self._all_gather("reshard-check", {"blocking": blocking, "error": error})
        values = sorted({p for f in found for p in f["blocking"]})
        return values, [f["error"] for f in found if f["error"] is not None]

    def exchange_inventories(
        self, inventory: RankInventory, proposal: dict[str, str]
    ) -> tuple[list[RankInventory], dict[str, str]]:
        """``inventory``: every rank's inventory (by rank) and rank 0's incarnation proposal
        (one incarnation id for the whole world)."""
        gathered = self._all_gather(
            "inventory", {"inventory": inventory.to_dict(), "incarnation": proposal}
        )
        invs = [RankInventory.from_dict(g["inventory"]) for g in gathered]
        return invs, gathered[0]["incarnation"]

    def settle_reshard(self, error: str | None) -> list[str]:
        """``reshard``: the ranks' failures to read their resharded slices (empty: all did)."""
        return [e for e in self._all_gather("reshard", error) if e is not None]

    def agree_staged(self, tier: str | None) -> list[str | None]:
        """``stage``: the tier that staged each rank's shard, by rank (None: that rank failed)."""
        return self._all_gather("stage", tier)

    def settle_load(self, step: int, own: BaseException | None) -> bool:
        """``load``: True when every rank loaded ``step``, False when some copy was corrupt
        (every rank re-plans); raises as :func:`strata.client.loader.settle_load` does."""
        return settle_load(self._all_gather("load", load_failure(own)), self.rank, step, own)

    def exchange_replicas(self, load: ShardedLoad) -> None:
        """``replicas``: sharded tensors' replicas from their owners, point to point."""
        self.trace.append("replicas")
        load.exchange(self.process_group)

    def settle_sharded(self, step: int, own: BaseException | None) -> None:
        """``sharded``: raises ``own``, else :class:`RestoreError` when another rank could not
        load its sharded tensors of ``step``."""
        errors = self._all_gather("sharded", None if own is None else f"rank {self.rank}: {own}")
        if own is not None:
            raise own
        failed = [e for e in errors if e is not None]
        if failed:
            raise RestoreError(f"step {step}: sharded tensors could not be loaded: {failed[0]}")

    def agree_dcp_step(self, verdict: Any) -> list[Any]:
        """``dcp-step``: every rank's verdict on the DCP reader's candidate step."""
        return self._all_gather("dcp-step", verdict)

    # -- the one all-gather -----------------------------------------------------------------------

    def _dist(self) -> Any:
        if (
            self.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        ):
            return torch.distributed
        return None

    def _all_gather(self, phase: Phase, obj: Any) -> list[Any]:
        self.trace.append(phase)
        dist = self._dist()
        if dist is None:
            return [obj]
        log.debug("strata restore: rank %d enters phase %s", self.rank, phase)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.process_group)
        return out
