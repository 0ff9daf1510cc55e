"""The promotion round: RAM -> PVC -> GCS for the ranks a sidecar serves (:class:`PromotionEngine`).

The engine builds the package's parts and wires them, each taking only the collaborators it
needs (none sees the engine): :class:`~strata.sidecar.promotion.ram_source.RamSource` (the local
ranks, their RAM steps and checksummed manifests),
:class:`~strata.sidecar.promotion.tier_views.TierViews` (each durable tier's live committed
steps), :class:`~strata.sidecar.promotion.copy.ShardCopier` (one shard, verified, with retries),
:class:`~strata.sidecar.promotion.committer.Committer` (the global commit record),
:class:`~strata.sidecar.promotion.tier_round.TierRound` (one tier's copy, verify, commit),
:class:`~strata.sidecar.promotion.maintenance.Maintenance` (commit records still missing,
:class:`~strata.sidecar.promotion.backfill.Backfill`,
:class:`~strata.sidecar.promotion.collection.Collector`,
:class:`~strata.sidecar.promotion.retention.Retention`),
:class:`~strata.sidecar.promotion.capacity.CapacityWatch` (a tier too small for keep + 1
steps), :func:`~strata.sidecar.promotion.pruning.prune_ram` (start-up) and
:func:`~strata.sidecar.promotion.flush.flush` (SIGTERM, over a
:class:`~strata.sidecar.promotion.flush.TierFlush`). The engine itself runs the round: one
RAM listing, then each durable tier under its lock.

What it does each round (:meth:`PromotionEngine.promote_once`), for the *local ranks* (the ranks
whose RAM data this sidecar sees, plus those declared through the local API):

1. Find the newest step committed in RAM for every local rank. Only shards whose manifest
   carries its checksums (``Manifest.verified``) are promoted; a committed shard left without
   checksums for ``seal_after_seconds`` (its writer died before its checksum pass) is checksummed
   by the sidecar under a lease and sealed (:meth:`RamTier.seal`).
2. For each durable tier in order (PVC, then GCS) whose interval policy is due for that step
   (:mod:`strata.sidecar.promotion.policies`), copy every local shard of it: to GCS from the PVC when the PVC
   already holds that exact shard, else from RAM while holding a :class:`~strata.tiers.slots.SlotLease`
   (C-05: the trainer may be writing step N+1 meanwhile; the lease keeps N's slot from being
   reused). The tier's ``put_shard`` checks the source against its manifest, writes data, then
   the manifest LAST; the engine then verifies the committed copy (CRC32C of the PVC file, the
   stored object's CRC32C on GCS) and quarantines a copy that does not match.
3. Retention (after a promotion, and every ``maintenance_seconds``): per durable tier, complete
   steps beyond ``keep`` lose this sidecar's ranks (:func:`plan_retention`); incomplete steps
   older than the newest complete step lose this sidecar's uncommitted data and the shards it
   wrote itself (writer id) after ``config.gc_grace_seconds``.
4. Back-fill and collection (with maintenance, for every incarnation's steps, whoever wrote
   them): a live step of an earlier incarnation that a faster durable tier holds and a slower
   one lacks is copied there when retention would keep it
   (:mod:`~strata.sidecar.promotion.backfill`); a superseded step below the tier's newest
   eligible step is deleted by its designated collector
   (:mod:`~strata.sidecar.promotion.collection`). Which steps are eligible or superseded is the
   one rule of :mod:`strata.tiers.eligible`.

Failures never stop the engine: one shard failing (I/O error, failed fsync, ENOSPC, checksum
mismatch) abandons that attempt -- the tier removed its partial files and nothing is committed --
and the shard is retried from the source in a later round with exponential backoff, at most
``max_attempts`` times per (tier, step, rank); a newer step supersedes it anyway. A corrupt
source is quarantined (RAM or PVC) and never retried in a loop (C-04).

Single-shot APIs for tests and SIGTERM: :meth:`promote_once` and :meth:`flush` (promote the
newest RAM step to the fastest durable tier within a deadline, C-14). :meth:`run` loops until
an event is set. Events (promotions, failures, deletions) go to ``on_event`` for metrics/reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from strata import faults
from strata.config import StrataConfig, TierName
from strata.sidecar.promotion.backfill import Backfill
from strata.sidecar.promotion.capacity import CapacityWatch
from strata.sidecar.promotion.collection import Collector
from strata.sidecar.promotion.committer import CommitDuty, Committer
from strata.sidecar.promotion.copy import ShardCopier
from strata.sidecar.promotion.events import PromotionEvent, RoundResult
from strata.sidecar.promotion.flush import FlushResult, TierFlush, flush
from strata.sidecar.promotion.maintenance import Maintenance
from strata.sidecar.promotion.policies import TierPolicy, tier_policies
from strata.sidecar.promotion.pruning import prune_ram
from strata.sidecar.promotion.ram_source import RamSource
from strata.sidecar.promotion.retention import Retention
from strata.sidecar.promotion.tier_round import TierRound
from strata.sidecar.promotion.tier_views import TierViews
from strata.sidecar.promotion.world import World
from strata.tiers.base import StepListing, Tier
from strata.tiers.ram import RamTier

log = logging.getLogger("strata.promotion")

DURABLE_TIERS: tuple[TierName, ...] = ("pvc", "gcs")
"""Durable tiers, fastest first (the SIGTERM flush goes to the first configured one)."""


class PromotionEngine:
    """Promotes this pod's RAM shards to the durable tiers and applies retention.

    ``ram``: the RAM tier; ``durable``: ``{"pvc": PosixTier, "gcs": GcsTier}`` (either optional).
    ``local_ranks``: ranks served by this sidecar besides those found in RAM (declared through
    the local API with :meth:`add_ranks`). ``policies``: default :func:`tier_policies(config)`.
    ``max_workers``: shards copied concurrently (bounded so promotion stays off the trainer's
    CPU budget). ``lease_timeout``: seconds to wait for a slot's writer before skipping the shard
    this round. Thread-safe: work on a tier is serialised by that tier's lock.
    """

    def __init__(
        self,
        config: StrataConfig,
        ram: RamTier,
        durable: Mapping[TierName, Tier],
        *,
        local_ranks: Iterable[int] = (),
        policies: Mapping[TierName, TierPolicy] | None = None,
        on_event: Callable[[PromotionEvent], None] | None = None,
        max_workers: int = 2,
        lease_timeout: float = 10.0,
        max_attempts: int = 3,
        backoff_seconds: float = 1.0,
        seal_after_seconds: float = 5.0,
        maintenance_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.job_id = job_id = config.job_id
        self.ram = ram
        self.durable: dict[TierName, Tier] = {
            name: durable[name] for name in DURABLE_TIERS if name in durable
        }
        self.policies = dict(policies) if policies is not None else tier_policies(config)
        missing = [t for t in self.durable if t not in self.policies]
        if missing:
            raise ValueError(f"no promotion policy for tier(s) {missing}")
        self.writer_id = config.pod_writer_id
        self._on_event = on_event
        self._clock = clock
        self._tier_locks: dict[TierName, threading.Lock] = {
            t: threading.Lock() for t in self.durable
        }
        self._stopping = threading.Event()
        emit = self._emit
        self.copier = ShardCopier(
            job_id,
            ram,
            self.durable,
            emit=emit,
            clock=clock,
            lease_timeout=lease_timeout,
            max_attempts=max_attempts,
            backoff_seconds=backoff_seconds,
            incremental_tiers={name: _incremental(config, name) for name in self.durable},
            components=config.archive_tiers(),
        )
        self.source = RamSource(
            ram,
            job_id,
            local_ranks=local_ranks,
            quarantine=self.copier.quarantine,
            emit=emit,
            clock=clock,
            seal_after_seconds=seal_after_seconds,
            lease_timeout=lease_timeout,
        )
        """The RAM side: local ranks, their steps and manifests (:mod:`.ram_source`)."""
        self.views = TierViews(job_id, self.durable, lambda: self.source.world, emit)
        """Each durable tier's live committed steps (:mod:`.tier_views`)."""
        self.capacity = CapacityWatch(job_id, self.durable, self.policies, emit)
        self.commits = CommitDuty(clock)
        """Designated commit writer per step, with takeover (:mod:`.committer`)."""
        committer = Committer(self.commits, job_id, self.durable, self.writer_id)
        intervals = {name: p.interval for name, p in self.policies.items()}
        keep = {name: p.retention for name, p in self.policies.items()}
        self.rounds = TierRound(
            self.views,
            intervals,
            self.copier,
            self.capacity,
            committer,
            clock=clock,
            started=clock(),
            max_workers=max_workers,
            emit=emit,
        )
        """One tier's copy, verify and commit (:mod:`.tier_round`)."""
        self.retention = Retention(
            job_id, grace_seconds=config.gc_grace_seconds, wrote=self.wrote, emit=emit
        )
        self.maintenance = Maintenance(
            self.views,
            keep,
            self.rounds.commit_missing,
            backfill=Backfill(self.views, self.copier, committer, keep, clock=clock, emit=emit),
            collector=Collector(self.views, committer, emit),
            retention=self.retention,
            clock=clock,
            wall_clock=wall_clock,
            every_seconds=maintenance_seconds,
        )
        """Per tier, after a promotion and every ``maintenance_seconds`` (:mod:`.maintenance`)."""
        self._flush_target = TierFlush(self.source, self.views, self.copier, self.rounds)

    # -- ranks and RAM state (:class:`RamSource`) -------------------------------------------------

    @property
    def world(self) -> World:
        """The newest snapshot of the current incarnation (:meth:`local_ranks` takes it)."""
        return self.source.world

    @property
    def too_small(self) -> dict[TierName, str]:
        """Tier -> why it cannot take keep + 1 steps (:class:`CapacityWatch`)."""
        return self.capacity.too_small

    def add_ranks(self, ranks: Iterable[int]) -> None:
        """Declare ranks served by this sidecar (the local API does this when a rank asks for slots)."""
        self.source.add_ranks(ranks)

    def local_ranks(self, ram_steps: dict[int, StepListing] | None = None) -> set[int]:
        """Local ranks of the current incarnation (:meth:`RamSource.local_ranks`)."""
        return self.source.local_ranks(ram_steps)

    def newest_ram_step(self, ranks: set[int] | None = None) -> int | None:
        """Newest step committed in RAM for every rank of ``ranks`` (default: local ranks)."""
        return max(self.source.steps_of(ranks), default=None)

    def last_promoted(self) -> dict[TierName, int | None]:
        """Per durable tier, its newest live committed step (None: none)."""
        return self.views.last_promoted()

    # -- the round --------------------------------------------------------------------------------

    def promote_once(
        self, *, force_tier: TierName | None = None, seal: bool = False
    ) -> RoundResult:
        """One round: promote the newest RAM step where due, then maintenance where due.

        ``force_tier``: promote to that tier regardless of its interval (flush).
        Each tier is worked on under its own lock, so a slow GCS upload never holds up the PVC
        (nor the SIGTERM flush to it). Never raises for a tier or shard failure (see the module
        docstring); returns what happened.
        """
        faults.point("promotion.round")
        result = RoundResult()
        listing = self.source.listing()  # one listing of the RAM tier per round
        ranks = self.source.local_ranks(listing)  # and one snapshot of the current incarnation
        ram_steps = self.source.steps_of(ranks, listing)
        step = max(ram_steps, default=None)
        manifests = self.source.manifests(step, ranks, seal) if step is not None else None
        if step is not None and manifests is not None:
            result.ram_step = step
        self._forget_older_than(step, min(ram_steps, default=None))
        progress = self.views.progress
        for name in self.durable:
            if force_tier is not None and name != force_tier:
                continue
            if self._stopping.is_set() and force_tier is None:
                break
            with self._tier_locks[name]:
                # Behind: re-read once this node's current incarnation changes (views.init).
                if not self.views.init(name, ranks) or progress[name].behind:
                    continue
                force = force_tier == name
                # The tier's own committed steps and its interval pick which RAM step (see
                # strata.sidecar.promotion.progress); a flush takes the newest.
                tier_step = step if force else self.rounds.choose(name, ram_steps)
                tier_manifests = manifests
                if tier_step != step:
                    tier_manifests = (
                        None if tier_step is None else self.source.manifests(tier_step, ranks, seal)
                    )
                if tier_step is not None and tier_manifests is not None:
                    self.rounds.promote_if_due(name, tier_step, tier_manifests, force, result)
                if force_tier is None:
                    self.maintenance.run_if_due(name, ranks, result)
        return result

    def _forget_older_than(self, step: int | None, oldest: int | None) -> None:
        """Drop bookkeeping of steps older than the newest RAM step (bounded memory); failed
        attempts only of steps that left RAM (a given-up step still there stays given up)."""
        if step is None:
            return
        self.source.forget_older_than(step)
        self.copier.forget_older_than(step if oldest is None else oldest)

    def wrote(self, writer_id: str) -> bool:
        """Whether a manifest's writer id is this pod's: the sidecar's own id, or one of its
        trainers' (the client stamps ``<pod writer id>/rank-<r>``)."""
        return writer_id == self.writer_id or writer_id.startswith(self.writer_id + "/")

    # -- SIGTERM ----------------------------------------------------------------------------------

    def fastest_durable(self) -> TierName | None:
        """The tier the SIGTERM flush goes to (None: no durable tier)."""
        return next(iter(self.durable), None)

    def flush(self, deadline: float) -> FlushResult:
        """Promote the newest committed RAM step to the fastest durable tier if no durable tier
        holds it or a newer step (C-14); ``deadline`` is on the engine's clock (default
        ``time.monotonic``).

        Stops interval promotion, waits (until the deadline) only for work in progress on the
        target tier, checksums RAM shards whose writer did not, and retries failed shards until
        the deadline. Only the target tier is listed (a slow or unreachable GCS never delays a
        flush to the PVC). Returns what happened; never raises.
        """
        self._stopping.set()  # from now on only forced rounds (the flush) promote
        tier = self.fastest_durable()
        return flush(self._flush_target, tier, self._tier_locks, self._clock, deadline)

    # -- loop, events, start-up (C-12) --------------------------------------------------------------

    def run(self, stop: threading.Event, interval_seconds: float = 0.5) -> None:
        """Call :meth:`promote_once` every ``interval_seconds`` until ``stop`` is set."""
        while not stop.is_set():
            try:
                self.promote_once()
            except Exception:  # a bug or an unexpected tier error must not kill the sidecar
                log.exception("promotion round failed; retrying in the next round")
            stop.wait(interval_seconds)

    def _emit(self, event: PromotionEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            log.exception("promotion event handler failed")

    def prune_ram(self) -> list[tuple[int, int]]:
        """Keep only the newest committed RAM step of each rank; drop everything else
        (:func:`strata.sidecar.promotion.pruning.prune_ram`). Returns the (step, rank) removed."""
        return prune_ram(self.ram, self.job_id, self.config.ram.keep)


def _incremental(config: StrataConfig, name: TierName) -> bool:
    """Whether tier ``name`` stores incremental copies (default True when the configuration
    does not describe that tier: an engine built with tiers of its own)."""
    tier = config.durable(name)
    return True if tier is None else tier.incremental
