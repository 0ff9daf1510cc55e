"""The trainer-side staging contract: :class:`Stager` (inventory and staging for one rank).

Three implementations: :class:`LocalStager` (tier objects in this process, no sidecar),
:class:`strata.client.sidecar_client.SidecarClient` (the sidecar over its unix socket; it is a
:class:`SidecarStager`) and :class:`strata.client.fallback.SidecarFallbackStager` (the sidecar
first, the local stager when it stops answering). :class:`strata.client.Checkpointer` takes any
of them as ``stager=``.

torch-free (the sidecar-side client imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from strata.protocol import ClientEvent, StageRequest
from strata.restore import RankInventory, StageResult, collect_inventory, stage_into_ram
from strata.tiers.base import Tier
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotProvider


class Stager(Protocol):
    """Inventory and staging for one rank (local tiers, or the sidecar over its socket)."""

    @property
    def defers_in_place_verify(self) -> bool:
        """Whether the last staging left a RAM hit unverified: the client then verifies it
        while loading it (one pass over the bytes, :mod:`strata.client.loader`)."""

    def inventory(self, job_id: str, rank: int, world_size: int) -> RankInventory:
        """What this rank can see in every tier (:func:`strata.restore.collect_inventory`)."""

    def stage(self, request: StageRequest) -> StageResult:
        """Put ``request``'s shard into the RAM tier (committed there) and return provenance; the
        result's ``path`` is the RAM data file. ``request.sources``: the tiers to try, nearest
        first (the plan's :attr:`strata.restore.RestorePlan.sources` for this rank; None: every
        tier). ``request.verify_in_place=False``: a RAM hit may be left unverified for the caller
        to verify while loading it; a stager may leave it to the caller anyway, and the result's
        ``deferred_verify`` says whether it did. Raises :class:`strata.errors.StageError`."""

    def report(self, event: ClientEvent) -> None:
        """Hand a save/restore event to whoever keeps metrics (best effort, never raises)."""


class SidecarStager(Stager, Protocol):
    """A :class:`Stager` in another process (the sidecar): it can be asked whether it answers.
    Its :meth:`Stager.stage` honours ``verify_in_place`` and raises
    :class:`strata.errors.ProtocolError` when the sidecar does not answer."""

    def ready(self) -> bool:
        """Whether the sidecar answers and is ready (never raises)."""


class LocalStager:
    """:class:`Stager` over tier objects in this process (no sidecar).

    A shard served by a tier other than RAM is copied into a RAM slot (from ``slot_provider``)
    and committed in the RAM tier, so the next restore is a RAM hit. A RAM hit is NOT verified
    here: the client verifies it while loading it (``defers_in_place_verify``; one pass over
    the bytes, :mod:`strata.client.loader`).
    """

    defers_in_place_verify = True

    def __init__(
        self,
        tiers: Sequence[Tier] | Callable[[], Sequence[Tier]],
        ram: RamTier,
        slot_provider: SlotProvider,
        verify: bool = True,
    ) -> None:
        self._tiers = tiers
        self.ram = ram
        self.slot_provider = slot_provider
        self.verify = verify

    def tiers(self) -> Sequence[Tier]:
        return self._tiers() if callable(self._tiers) else self._tiers

    def inventory(self, job_id: str, rank: int, world_size: int) -> RankInventory:
        return collect_inventory(self.tiers(), job_id, rank, world_size)

    def stage(self, request: StageRequest) -> StageResult:
        """:meth:`Stager.stage`; a RAM hit is always left to the caller (``deferred_verify``)."""
        return stage_into_ram(
            self.tiers(),
            self.ram,
            self.slot_provider,
            request.job_id,
            request.step,
            request.rank,
            world_size=request.world_size,
            verify=self.verify,
            sources=request.sources,
            verify_in_place=False,
        )

    def report(self, event: ClientEvent) -> None:
        """No sidecar to tell: events are only logged by the client itself."""
