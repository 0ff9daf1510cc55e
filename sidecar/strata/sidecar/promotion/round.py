"""The promotion round: RAM -> PVC -> GCS for the ranks a sidecar serves (:class:`PromotionEngine`).

The engine composes the package's parts, each taking only what it needs:
:class:`~strata.sidecar.promotion.ram_source.RamSource` (the local ranks, their RAM steps and
checksummed manifests), :class:`~strata.sidecar.promotion.tier_views.TierViews` (each durable
tier's live committed steps), :class:`~strata.sidecar.promotion.copy.ShardCopier` (one shard,
verified, with retries), :class:`~strata.sidecar.promotion.committer.CommitDuty` (the global
commit record), :class:`~strata.sidecar.promotion.retention.Retention`,
:class:`~strata.sidecar.promotion.capacity.CapacityWatch` (a tier too small for keep + 1
steps), :func:`~strata.sidecar.promotion.pruning.prune_ram` (start-up) and
:func:`~strata.sidecar.promotion.flush.flush` (SIGTERM; it sees the engine only as a
:class:`~strata.sidecar.promotion.flush.FlushTarget`).

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
from concurrent.futures import ThreadPoolExecutor

from strata import faults
from strata.config import StrataConfig, TierName
from strata.errors import CommitError, TierError
from strata.format.commit import StepCommit
from strata.format.incarnation import Incarnation, Lineage
from strata.format.manifest import Manifest
from strata.sidecar.promotion.backfill import backfill_steps
from strata.sidecar.promotion.capacity import CapacityWatch
from strata.sidecar.promotion.collection import collectible_steps, shards_superseded
from strata.sidecar.promotion.committer import CommitDuty
from strata.sidecar.promotion.copy import ShardCopier
from strata.sidecar.promotion.events import PromotionEvent, RoundResult
from strata.sidecar.promotion.flush import FlushAttempt, FlushResult, FlushView, flush
from strata.sidecar.promotion.policies import TierPolicy, tier_policies
from strata.sidecar.promotion.progress import choose_step
from strata.sidecar.promotion.pruning import prune_ram
from strata.sidecar.promotion.ram_source import RamSource
from strata.sidecar.promotion.retention import Retention
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
        self.job_id = config.job_id
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
        self.max_workers = max(1, max_workers)
        self.maintenance_seconds = maintenance_seconds
        self._clock = clock
        self._wall = wall_clock
        self._tier_locks: dict[TierName, threading.Lock] = {
            t: threading.Lock() for t in self.durable
        }
        self._stopping = threading.Event()
        self._started = clock()
        self.copier = ShardCopier(
            self.job_id,
            ram,
            self.durable,
            emit=self._emit,
            clock=clock,
            lease_timeout=lease_timeout,
            max_attempts=max_attempts,
            backoff_seconds=backoff_seconds,
            incremental_tiers={name: _incremental(config, name) for name in self.durable},
            components=config.archive_tiers(),
        )
        self.source = RamSource(
            ram,
            self.job_id,
            local_ranks=local_ranks,
            quarantine=self.copier.quarantine,
            emit=self._emit,
            clock=clock,
            seal_after_seconds=seal_after_seconds,
            lease_timeout=lease_timeout,
        )
        """The RAM side: local ranks, their steps and manifests (:mod:`.ram_source`)."""
        self.views = TierViews(self.job_id, self.durable, lambda: self.source.world, self._emit)
        """Each durable tier's live committed steps (:mod:`.tier_views`)."""
        self._progress = self.views.progress
        self.capacity = CapacityWatch(self.job_id, self.durable, self.policies, self._emit)
        self.retention = Retention(
            self.job_id, grace_seconds=config.gc_grace_seconds, wrote=self.wrote, emit=self._emit
        )
        self.commits = CommitDuty(clock)
        """Designated commit writer per step, with takeover (:mod:`.committer`)."""

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
        return self.views.last_promoted()

    # -- the round --------------------------------------------------------------------------------

    def promote_once(
        self, *, force_tier: TierName | None = None, seal: bool = False
    ) -> RoundResult:
        """One round: promote the newest RAM step where due, then retention where due.

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
        for name in self.durable:
            if force_tier is not None and name != force_tier:
                continue
            if self._stopping.is_set() and force_tier is None:
                break
            with self._tier_locks[name]:
                # Behind: re-read once this node's current incarnation changes (views.init).
                if not self.views.init(name, ranks) or self._progress[name].behind:
                    continue
                force = force_tier == name
                # The tier's own committed steps and its interval pick which RAM step (see
                # strata.sidecar.promotion.progress); a flush takes the newest.
                p = self._progress[name]
                tier_step = (
                    step
                    if force
                    else choose_step(
                        p,
                        self.policies[name].interval,
                        ram_steps,
                        self._clock(),
                        p.last_time or self._started,
                        self.copier.given_up(name),
                    )
                )
                tier_manifests = manifests
                if tier_step != step:
                    tier_manifests = (
                        None if tier_step is None else self.source.manifests(tier_step, ranks, seal)
                    )
                if tier_step is not None and tier_manifests is not None:
                    self._promote_if_due(name, tier_step, tier_manifests, force, result)
                if force_tier is None:
                    self._maintain_if_due(name, ranks, result)
        return result

    def _forget_older_than(self, step: int | None, oldest: int | None) -> None:
        """Drop bookkeeping of steps older than the newest RAM step (bounded memory); failed
        attempts only of steps that left RAM (a given-up step still there stays given up)."""
        if step is None:
            return
        self.source.forget_older_than(step)
        self.copier.forget_older_than(step if oldest is None else oldest)

    def _promote_if_due(
        self,
        name: TierName,
        step: int,
        manifests: dict[int, Manifest],
        force: bool,
        result: RoundResult,
    ) -> None:
        progress = self._progress[name]
        if progress.last_step is not None and step <= progress.last_step:
            return
        waiting = step in progress.placed and set(manifests) <= progress.placed[step]
        due = (
            force
            or waiting
            or self.policies[name].interval.due(
                step, progress.last_step, self._clock(), progress.last_time or self._started
            )
        )
        if not due:
            return
        if not waiting:
            failures = self._promote_step(name, step, manifests)
            if failures:
                result.failed[name] = failures
                return
            result.promoted[name] = step
        self._commit(name, step, result)

    def _commit(self, name: TierName, step: int, result: RoundResult) -> None:
        """Learn or write the step's global commit record in the tier: its designated writer
        writes it once every rank's shard of the current incarnation is there, the others read
        it (or take over after a timeout); :mod:`strata.sidecar.promotion.committer`."""
        tier = self.durable[name]
        try:
            commit = self.commits.settle(
                tier,
                self.job_id,
                step,
                writer_id=self.writer_id,
                ranks=self.world.ranks,
                world_size=self.world.world_size,
                incarnation=self.world.incarnation,
                records=self.world.chain(),
            )
        except (TierError, CommitError) as exc:
            log.warning("commit record of step %d in %s not written: %s", step, name, exc)
            return
        if commit is None:
            return
        progress = self._progress[name]
        progress.set_committed({**progress.committed, step: commit})
        result.committed[name] = step
        self._emit(PromotionEvent("committed", name, step, tuple(range(commit.world_size))))

    def _maintain_if_due(self, name: TierName, ranks: set[int], result: RoundResult) -> None:
        p = self._progress[name]
        now = self._clock()
        if name in result.promoted or (
            p.last_maintenance is None or now - p.last_maintenance >= self.maintenance_seconds
        ):
            p.last_maintenance = now
            self._commit_finished(name, result)
            self._backfill(name, ranks, result)
            collected = self._collect(name, result)
            deleted = self.retention.maintain(
                self.durable[name],
                ranks,
                self.policies[name].retention,
                now=self._wall(),
                first_seen=p.first_seen,
                complete=set(p.committed),
            )
            if deleted:
                result.deleted[name] = sorted({*result.deleted.get(name, []), *deleted})
            if deleted or collected:
                self.views.refresh(name)

    # -- back-fill and collection (any sidecar, for any incarnation's steps) ----------------------

    def _backfill(self, name: TierName, ranks: set[int], result: RoundResult) -> None:
        """Copy into ``name`` the live steps of earlier incarnations that a faster durable tier
        holds and ``name`` lacks, where retention would keep them
        (:mod:`strata.sidecar.promotion.backfill`). Failures are retried in later rounds."""
        p = self._progress[name]
        world = self.world
        if p.behind is not None or world.incarnation is None or not ranks:
            return
        for src_name in self.durable:
            if src_name == name:
                return
            src = self._progress[src_name]
            if not src.initialised or src.behind is not None:
                continue
            steps = backfill_steps(
                src.committed, p.committed, self.policies[name].retention, world.incarnation
            )
            for step in steps:
                self._backfill_step(name, src_name, src.committed[step], ranks, result)
            if steps:
                return

    def _backfill_step(
        self,
        name: TierName,
        src_name: TierName,
        commit: StepCommit,
        ranks: set[int],
        result: RoundResult,
    ) -> None:
        step, w = commit.step, commit.world_size
        world = self.world
        mine = {r for r in ranks if r < w}
        if self.commits.designated(step, world.world_size, ranks):
            mine |= set(range(min(world.world_size or w, w), w))  # ranks no sidecar here serves
        source = self.durable[src_name]
        copied: list[int] = []
        nbytes = 0
        started = self._clock()
        for rank in sorted(mine):
            try:
                m = source.get_manifest(self.job_id, step, rank)
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
            self._emit(PromotionEvent("promoted", name, step, tuple(copied), nbytes, seconds))
        try:
            done = self.commits.settle(
                self.durable[name],
                self.job_id,
                step,
                writer_id=self.writer_id,
                ranks=ranks,
                world_size=world.world_size,
                incarnation=commit.incarnation,
                records=_chain(self._progress[src_name].lineage.records, commit.incarnation),
            )
        except (TierError, CommitError) as exc:
            log.warning("commit record of back-filled step %d in %s: %s", step, name, exc)
            return
        if done is not None:
            result.committed.setdefault(name, step)
            self._emit(PromotionEvent("committed", name, step, tuple(range(done.world_size))))

    def _collect(self, name: TierName, result: RoundResult) -> list[int]:
        """Delete the superseded steps of ``name`` this sidecar is the designated collector of
        (:mod:`strata.sidecar.promotion.collection`); returns the steps deleted."""
        p = self._progress[name]
        world = self.world
        if p.behind is not None or world.incarnation is None or p.last_step is None:
            return []
        if not all(q.initialised for q in self._progress.values()):
            return []  # a tier whose view is unknown may hold a live copy being back-filled
        tier = self.durable[name]
        elsewhere = {s for n, q in self._progress.items() if n != name for s in q.committed}

        def designated(step: int) -> bool:
            return self.commits.designated(step, world.world_size, world.ranks)

        steps = collectible_steps(
            p.lineage, p.dead, p.last_step, eligible_elsewhere=elsewhere, designated=designated
        )
        try:
            for s in tier.step_numbers(self.job_id):
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
                tier.delete_step(self.job_id, s)
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
        if deleted:
            result.deleted[name] = sorted({*result.deleted.get(name, []), *deleted})
        return deleted

    def _uncommitted_superseded(self, tier: Tier, step: int, lin: Lineage) -> bool:
        listing = tier.list_step(self.job_id, step)
        if listing is None or listing.has_commit:
            return False
        manifests = []
        for rank in sorted(listing.committed_ranks):
            try:
                manifests.append(tier.get_manifest(self.job_id, step, rank))
            except TierError:
                return False
        return shards_superseded(lin, step, manifests)

    def _commit_finished(self, name: TierName, result: RoundResult) -> None:
        """Commit steps newer than the tier's newest commit whose record is missing: steps
        this sidecar placed shards of (their designated writer may have died: takeover) and
        steps it is the designated writer of (its RAM may have lost them). One listing of the
        step names, never of the shards (:mod:`strata.sidecar.promotion.committer`)."""
        if not self.views.refresh(name):
            return
        p = self._progress[name]
        try:
            steps = self.durable[name].step_numbers(self.job_id)
        except TierError:
            return
        for step in steps:
            if step in p.committed or (p.last_step is not None and step <= p.last_step):
                continue
            if step in p.placed or self.commits.designated(
                step, self.world.world_size, self.world.ranks
            ):
                self._commit(name, step, result)

    def _promote_step(self, name: TierName, step: int, manifests: dict[int, Manifest]) -> list[str]:
        """Copy every local shard of ``step`` into tier ``name``; returns failure messages.

        A shard of a superseded incarnation already there for a rank (a replay rewrites the
        step) is removed first: it can never be restored, and GCS never overwrites an object."""
        started = self._clock()
        ranks = sorted(manifests)
        self.views.drop_superseded(name, step, ranks)
        with ThreadPoolExecutor(
            max_workers=min(self.max_workers, len(ranks)), thread_name_prefix=f"strata-{name}"
        ) as pool:
            outcomes = list(
                pool.map(lambda r: self.copier.promote_shard(name, step, r, manifests[r]), ranks)
            )
        failures = [msg for ok, _n, msg in outcomes if not ok]
        if failures:
            if self.copier.full.get(name) == step:
                self.capacity.check(name, step, manifests)
            return failures
        self.copier.full.pop(name, None)
        self.capacity.fits(name, step)
        nbytes = sum(n for _ok, n, _msg in outcomes)
        seconds = self._clock() - started
        progress = self._progress[name]
        progress.placed.setdefault(step, set()).update(ranks)
        progress.last_time = self._clock()
        log.info(
            "promoted step %d to %s (%d bytes, %.3fs)",
            step,
            name,
            nbytes,
            seconds,
            extra={
                "event": "promoted",
                "tier": name,
                "step": step,
                "bytes": nbytes,
                "ranks": ranks,
            },
        )
        self._emit(PromotionEvent("promoted", name, step, tuple(ranks), nbytes, seconds))
        return []

    # -- retention --------------------------------------------------------------------------------

    def wrote(self, writer_id: str) -> bool:
        """Whether a manifest's writer id is this pod's: the sidecar's own id, or one of its
        trainers' (the client stamps ``<pod writer id>/rank-<r>``)."""
        return writer_id == self.writer_id or writer_id.startswith(self.writer_id + "/")

    # -- SIGTERM (the engine as a :class:`~strata.sidecar.promotion.flush.FlushTarget`) -----------

    def fastest_durable(self) -> TierName | None:
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
        return flush(self, deadline)

    def now(self) -> float:
        """The engine's clock (seconds; deadlines are on it)."""
        return self._clock()

    def stop_interval_promotion(self) -> None:
        """From now on only forced rounds (the flush) promote."""
        self._stopping.set()

    def tier_lock(self, name: TierName) -> threading.Lock:
        """The lock serialising work on one durable tier."""
        return self._tier_locks[name]

    def flush_view(self, tier: TierName) -> FlushView:
        """Under ``tier``'s lock: the local ranks, their newest common RAM step and the newest
        step on a durable tier (one listing of the RAM tier, one read of ``tier``)."""
        listing = self.source.listing()
        ranks = self.source.local_ranks(listing)
        self.views.init(tier, ranks)
        step = max(self.source.steps_of(ranks, listing), default=None)
        return FlushView(ranks, step, self.newest_durable_step(tier, ranks))

    def force_promote(self, tier: TierName, step: int, ranks: set[int]) -> FlushAttempt:
        """Under ``tier``'s lock: one forced promotion of ``step`` for ``ranks``, ignoring the
        shards' backoff and checksumming RAM shards whose writer did not."""
        for rank in ranks:
            self.copier.reset(tier, step, rank)
        manifests = self.source.manifests(step, ranks, seal=True)
        if manifests is None:
            return FlushAttempt(False)
        result = RoundResult(ram_step=step)
        self._promote_if_due(tier, step, manifests, True, result)
        if result.promoted.get(tier) == step:
            return FlushAttempt(True, nbytes=sum(m.data_nbytes for m in manifests.values()))
        return FlushAttempt(False, failures=result.failed.get(tier))

    def holds(self, tier: TierName, step: int, ranks: set[int]) -> bool:
        """This engine committed ``step`` (or a newer one) in ``tier``, or placed the shards of
        every rank of ``ranks`` there (their commit record may still wait for other nodes)."""
        progress = self._progress[tier]
        if progress.last_step is not None and step <= progress.last_step:
            return True
        placed = progress.placed.get(step)
        return placed is not None and bool(ranks) and ranks <= placed

    def newest_durable_step(self, tier: TierName, ranks: set[int]) -> int | None:
        """Newest step holding every local shard on a durable tier: what this engine promoted
        or found at start, and a fresh read of ``tier`` (:meth:`TierViews.newest_durable_step`)."""
        return self.views.newest_durable_step(tier)

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


def _chain(records: Mapping[str, Incarnation], incarnation: str) -> list[Incarnation]:
    """The records of ``incarnation`` and its known ancestors (copied next to a commit)."""
    out: list[Incarnation] = []
    inc: str | None = incarnation
    while inc and inc in records and records[inc] not in out:
        out.append(records[inc])
        inc = records[inc].parent
    return out


def _incremental(config: StrataConfig, name: TierName) -> bool:
    """Whether tier ``name`` stores incremental copies (default True when the configuration
    does not describe that tier: an engine built with tiers of its own)."""
    tier = config.durable(name)
    return True if tier is None else tier.incremental
