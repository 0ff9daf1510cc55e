"""The RAM side of promotion: :class:`RamSource` (what this node's RAM tier holds to promote).

For one job: the *local ranks* of the current incarnation (the ranks whose RAM data this sidecar
sees, plus those declared through the local API; :mod:`strata.sidecar.promotion.world`), the
steps committed in RAM for every one of them, and their checksummed manifests. Only shards whose
manifest carries its checksums (``Manifest.verified``) are promoted; a committed shard left
without checksums for ``seal_after_seconds`` (its writer died before its checksum pass) is
checksummed here under a lease and sealed (:meth:`strata.tiers.ram.RamTier.seal`). A corrupt
RAM manifest is handed to ``quarantine`` (C-04).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from strata.errors import ShardCorrupt, ShardUnavailable
from strata.format.manifest import Manifest
from strata.sidecar.promotion.events import PromotionEvent
from strata.sidecar.promotion.world import RamWorld, World
from strata.tiers.base import StepListing, Tier
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotLease

log = logging.getLogger("strata.promotion")


class RamSource:
    """The RAM tier ``ram`` of job ``job_id`` as a promotion source.

    ``local_ranks``: ranks declared up front (more with :meth:`add_ranks`). ``quarantine(tier,
    step, rank, reason)``: called for a corrupt RAM manifest. ``emit``: promotion events
    ("sealed"). ``clock``: monotonic seconds. ``lease_timeout``: seconds to wait for a slot's
    writer before skipping a shard to seal.
    """

    def __init__(
        self,
        ram: RamTier,
        job_id: str,
        *,
        local_ranks: Iterable[int],
        quarantine: Callable[[Tier, int, int, str], None],
        emit: Callable[[PromotionEvent], None],
        clock: Callable[[], float],
        seal_after_seconds: float,
        lease_timeout: float,
    ) -> None:
        self.ram = ram
        self.job_id = job_id
        self._declared: set[int] = set(local_ranks)
        self._quarantine = quarantine
        self._emit = emit
        self._clock = clock
        self.seal_after_seconds = seal_after_seconds
        self.lease_timeout = lease_timeout
        self.ram_world = RamWorld(ram, job_id)
        self.world = World(None, None, frozenset())
        """The newest snapshot of the current incarnation (:meth:`local_ranks` takes it)."""
        self._unverified_since: dict[tuple[int, int], float] = {}

    def add_ranks(self, ranks: Iterable[int]) -> None:
        """Declare ranks served by this sidecar (the local API does this when a rank asks for slots)."""
        self._declared.update(ranks)

    def listing(self) -> dict[int, StepListing]:
        """One listing of the RAM tier (rank -> its steps)."""
        return self.ram.list_steps(self.job_id)

    def local_ranks(self, listing: dict[int, StepListing] | None = None) -> set[int]:
        """Local ranks of the current incarnation: declared ranks and ranks holding its RAM
        shards, below its world size; leftover slot directories only count while nothing is
        saved on this node (``listing``: a listing already taken, to avoid a second one).
        Takes a new :attr:`world` snapshot."""
        listing = self.listing() if listing is None else listing
        self.world = self.ram_world.snapshot(listing, self._declared)
        return set(self.world.ranks)

    def steps_of(
        self, ranks: set[int] | None = None, listing: dict[int, StepListing] | None = None
    ) -> list[int]:
        """Steps committed in RAM for every rank of ``ranks`` (default: local ranks)."""
        listing = self.listing() if listing is None else listing
        ranks = self.local_ranks(listing) if ranks is None else ranks
        if not ranks:
            return []
        return self.world.steps(ranks)

    def manifests(self, step: int, ranks: set[int], seal: bool) -> dict[int, Manifest] | None:
        """Checksummed RAM manifests of ``step`` for ``ranks``; None when some are not yet.

        ``seal``: checksum unverified shards now (SIGTERM flush, or a writer that stopped
        before its checksum pass for longer than ``seal_after_seconds``).
        """
        out: dict[int, Manifest] = {}
        for rank in sorted(ranks):
            try:
                m = self.ram.get_manifest(self.job_id, step, rank)
            except ShardCorrupt as exc:
                self._quarantine(self.ram, step, rank, str(exc))
                return None
            except ShardUnavailable:
                return None
            if not m.verified:
                first = self._unverified_since.setdefault((step, rank), self._clock())
                if not (seal or self._clock() - first >= self.seal_after_seconds):
                    return None
                sealed = self._seal(step, rank)
                if sealed is None:
                    return None
                m = sealed
            out[rank] = m
        return out

    def forget_older_than(self, step: int) -> None:
        """Drop the bookkeeping of shards of steps older than ``step`` (bounded memory)."""
        for key in [k for k in self._unverified_since if k[0] < step]:
            self._unverified_since.pop(key, None)

    def _seal(self, step: int, rank: int) -> Manifest | None:
        """Checksum a committed RAM shard whose writer did not, and record the checksums."""
        try:
            with SlotLease(self.ram, self.job_id, step, rank, timeout=self.lease_timeout) as lease:
                m = lease.manifest
                assert m is not None
                if m.verified:
                    return m
                sealed = self.ram.seal(lease)
        except (ShardUnavailable, ValueError, OSError) as exc:
            log.warning("cannot checksum RAM shard rank %d step %d: %s", rank, step, exc)
            return None
        self._emit(PromotionEvent("sealed", "ram", step, (rank,), message="checksummed by sidecar"))
        if sealed is not None:
            return sealed
        try:  # its writer checksummed it meanwhile
            return self.ram.get_manifest(self.job_id, step, rank)
        except ShardUnavailable:
            return None
