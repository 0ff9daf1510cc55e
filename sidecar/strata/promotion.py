"""Promotion and retention engine: RAM -> PVC -> GCS for the ranks a sidecar serves.

What it does each round (:meth:`PromotionEngine.promote_once`), for the *local ranks* (the ranks
whose RAM data this sidecar sees, plus those declared through the local API):

1. Find the newest step committed in RAM for every local rank. Only shards whose manifest
   carries its checksums (``Manifest.verified``) are promoted; a committed shard left without
   checksums for ``seal_after_seconds`` (its writer died before its checksum pass) is checksummed
   by the sidecar under a lease and sealed (:meth:`RamTier.update_checksums`).
2. For each durable tier in order (PVC, then GCS) whose interval policy is due for that step
   (:mod:`strata.policies`), copy every local shard of it: to GCS from the PVC when the PVC
   already holds that exact shard, else from RAM while holding a :class:`~strata.tiers.ram.SlotLease`
   (C-05: the trainer may be writing step N+1 meanwhile; the lease keeps N's slot from being
   reused). The tier's ``put_shard`` checks the source against its manifest, writes data, then
   the manifest LAST; the engine then verifies the committed copy (CRC32C of the PVC file, the
   stored object's CRC32C on GCS) and quarantines a copy that does not match.
3. Retention (after a promotion, and every ``maintenance_seconds``): per durable tier, complete
   steps beyond ``keep`` lose this sidecar's ranks (:func:`plan_retention`); incomplete steps
   older than the newest complete step lose this sidecar's uncommitted data and the shards it
   wrote itself (writer id) after ``config.gc_grace_seconds``.

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
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from strata import crc
from strata.config import SidecarConfig, TierName
from strata.manifest import Manifest
from strata.policies import RetentionPolicy, TierPolicy, tier_policies
from strata.tiers.base import ShardCorrupt, ShardUnavailable, StepListing, Tier, TierError
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier, SlotLease

log = logging.getLogger("strata.promotion")

DURABLE_TIERS: tuple[TierName, ...] = ("pvc", "gcs")
"""Durable tiers, fastest first (the SIGTERM flush goes to the first configured one)."""

EventKind = Literal[
    "promoted", "failed", "gave_up", "checksum_mismatch", "retention", "gc", "sealed"
]


@dataclass(frozen=True)
class PromotionEvent:
    """Something the engine did; ``tier`` is where it happened (the corrupt copy's tier for
    ``checksum_mismatch``)."""

    kind: EventKind
    tier: TierName
    step: int | None
    ranks: tuple[int, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    message: str = ""


@dataclass
class RoundResult:
    """Outcome of one :meth:`PromotionEngine.promote_once`."""

    ram_step: int | None = None
    """Newest step committed (and checksummed) in RAM for every local rank."""
    promoted: dict[TierName, int] = field(default_factory=dict)
    """Tier -> step whose local shards are now all committed there (promoted this round)."""
    failed: dict[TierName, list[str]] = field(default_factory=dict)
    deleted: dict[TierName, list[int]] = field(default_factory=dict)


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
) -> RetentionPlan:
    """Which steps of a tier to delete (pure).

    Rules (DESIGN.md "Commit protocol"): only complete steps are pruned, by ``retention``, which
    never returns the newest complete step; nothing is deleted while no step is complete;
    incomplete steps newer than the newest complete step are never touched (a save or a
    promotion may be in flight); an incomplete step older than it is garbage once its newest file
    is older than ``grace_seconds`` (``now`` and ``mtime``: seconds since the epoch; a listing
    without ``mtime`` counts from ``first_seen[step]``, when this engine first saw it).
    """
    complete = sorted(s for s, listing in listings.items() if listing.complete)
    if not complete:
        return RetentionPlan()
    newest = complete[-1]
    prune = tuple(s for s in retention.to_delete(complete) if s != newest)
    gc: list[int] = []
    waiting: list[int] = []
    for step in sorted(listings):
        listing = listings[step]
        if listing.complete or step >= newest:
            continue
        since = listing.mtime
        if since is None:
            since = (first_seen or {}).get(step, now)
        (gc if now - since > grace_seconds else waiting).append(step)
    return RetentionPlan(prune=prune, gc=tuple(gc), waiting=tuple(waiting))


@dataclass
class _TierProgress:
    initialised: bool = False
    last_step: int | None = None
    last_time: float | None = None
    last_maintenance: float | None = None
    first_seen: dict[int, float] = field(default_factory=dict)


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
        config: SidecarConfig,
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
        self._declared: set[int] = set(local_ranks)
        self._on_event = on_event
        self.max_workers = max(1, max_workers)
        self.lease_timeout = lease_timeout
        self.max_attempts = max_attempts
        self.backoff_seconds = backoff_seconds
        self.seal_after_seconds = seal_after_seconds
        self.maintenance_seconds = maintenance_seconds
        self._clock = clock
        self._wall = wall_clock
        self._progress: dict[TierName, _TierProgress] = {t: _TierProgress() for t in self.durable}
        self._attempts: dict[tuple[TierName, int, int], tuple[int, float]] = {}
        self._unverified_since: dict[tuple[int, int], float] = {}
        self._tier_locks: dict[TierName, threading.Lock] = {
            t: threading.Lock() for t in self.durable
        }
        self._stopping = threading.Event()
        self._started = clock()

    # -- ranks and RAM state ----------------------------------------------------------------------

    def add_ranks(self, ranks: Iterable[int]) -> None:
        """Declare ranks served by this sidecar (the local API does this when a rank asks for slots)."""
        self._declared.update(ranks)

    def local_ranks(self, ram_steps: dict[int, StepListing] | None = None) -> set[int]:
        """Declared ranks plus every rank with slots or shards in this job's RAM directory
        (``ram_steps``: a listing of the RAM tier already taken, to avoid a second one)."""
        ranks = set(self._declared)
        slots_root = self.ram.root / self.job_id / "slots"
        try:
            for entry in os.scandir(slots_root):
                if entry.name.startswith("rank-") and entry.name[5:].isdigit():
                    ranks.add(int(entry.name[5:]))
        except FileNotFoundError:
            pass
        for listing in (self.ram_steps() if ram_steps is None else ram_steps).values():
            ranks.update(listing.committed_ranks)
        return ranks

    def ram_steps(self) -> dict[int, StepListing]:
        return self.ram.list_steps(self.job_id)

    def newest_ram_step(self, ranks: set[int] | None = None) -> int | None:
        """Newest step committed in RAM for every rank of ``ranks`` (default: local ranks)."""
        return max(self._ram_steps_of(ranks), default=None)

    def _ram_steps_of(
        self, ranks: set[int] | None = None, ram_steps: dict[int, StepListing] | None = None
    ) -> list[int]:
        """Steps committed in RAM for every rank of ``ranks`` (default: local ranks)."""
        listing = self.ram_steps() if ram_steps is None else ram_steps
        ranks = self.local_ranks(listing) if ranks is None else ranks
        if not ranks:
            return []
        return [s for s, entry in listing.items() if ranks <= entry.committed_ranks]

    def _ram_manifests(self, step: int, ranks: set[int], seal: bool) -> dict[int, Manifest] | None:
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

    def _seal(self, step: int, rank: int) -> Manifest | None:
        """Checksum a committed RAM shard whose writer did not, and record the checksums."""
        try:
            with SlotLease(self.ram, self.job_id, step, rank, timeout=self.lease_timeout) as lease:
                m = lease.manifest
                assert m is not None
                if m.verified:
                    return m
                crcs, whole = crc.file_chunk_crcs(lease.path, m.data_nbytes, m.chunk_size)
                sealed = self.ram.update_checksums(self.job_id, step, rank, crcs, whole)
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

    # -- tier progress ----------------------------------------------------------------------------

    def _init_tier(self, name: TierName, ranks: set[int]) -> bool:
        """Start a durable tier's interval from the newest step it already holds for ``ranks``
        (once, when the ranks are known); False while that listing has not succeeded."""
        progress = self._progress[name]
        if progress.initialised:
            return True
        if not ranks:
            return False
        try:
            step = self._newest_local_step(self.durable[name], ranks)
        except TierError as exc:
            log.warning("cannot list the %s tier yet: %s", name, exc)
            return False
        if progress.last_step is None or (step is not None and step > progress.last_step):
            progress.last_step = step
        progress.initialised = True
        return True

    def _newest_local_step(self, tier: Tier, ranks: set[int]) -> int | None:
        if not ranks:
            return None
        steps = [s for s, li in tier.list_steps(self.job_id).items() if ranks <= li.committed_ranks]
        return max(steps) if steps else None

    def last_promoted(self) -> dict[TierName, int | None]:
        return {name: p.last_step for name, p in self._progress.items()}

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
        result = RoundResult()
        listing = self.ram_steps()  # one listing of the RAM tier per round
        ranks = self.local_ranks(listing)
        ram_steps = self._ram_steps_of(ranks, listing)
        step = max(ram_steps, default=None)
        manifests = self._ram_manifests(step, ranks, seal) if step is not None else None
        if step is not None and manifests is not None:
            result.ram_step = step
        self._forget_older_than(step)
        for name in self.durable:
            if force_tier is not None and name != force_tier:
                continue
            if self._stopping.is_set() and force_tier is None:
                break
            with self._tier_locks[name]:
                if not self._init_tier(name, ranks):
                    continue
                force = force_tier == name
                # The tier's interval picks which RAM step (e.g. a multiple of every.steps);
                # a flush takes the newest.
                tier_step = step if force else self.policies[name].interval.candidate(ram_steps)
                tier_manifests = manifests
                if tier_step != step:
                    tier_manifests = (
                        None if tier_step is None else self._ram_manifests(tier_step, ranks, seal)
                    )
                if tier_step is not None and tier_manifests is not None:
                    self._promote_if_due(name, tier_step, tier_manifests, force, result)
                if force_tier is None:
                    self._maintain_if_due(name, ranks, result)
        return result

    def _forget_older_than(self, step: int | None) -> None:
        """Drop bookkeeping of steps older than the newest RAM step (bounded memory)."""
        if step is None:
            return
        for key in [k for k in self._unverified_since if k[0] < step]:
            self._unverified_since.pop(key, None)
        for akey in [k for k in self._attempts if k[1] < step]:
            self._attempts.pop(akey, None)

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
        due = force or self.policies[name].interval.due(
            step, progress.last_step, self._clock(), progress.last_time or self._started
        )
        if not due:
            return
        failures = self._promote_step(name, step, manifests)
        if failures:
            result.failed[name] = failures
        else:
            result.promoted[name] = step

    def _maintain_if_due(self, name: TierName, ranks: set[int], result: RoundResult) -> None:
        p = self._progress[name]
        now = self._clock()
        if name in result.promoted or (
            p.last_maintenance is None or now - p.last_maintenance >= self.maintenance_seconds
        ):
            p.last_maintenance = now
            deleted = self._maintain(name, ranks)
            if deleted:
                result.deleted[name] = deleted

    def _promote_step(self, name: TierName, step: int, manifests: dict[int, Manifest]) -> list[str]:
        """Copy every local shard of ``step`` into tier ``name``; returns failure messages."""
        started = self._clock()
        ranks = sorted(manifests)
        with ThreadPoolExecutor(
            max_workers=min(self.max_workers, len(ranks)), thread_name_prefix=f"strata-{name}"
        ) as pool:
            outcomes = list(
                pool.map(lambda r: self._promote_shard(name, step, r, manifests[r]), ranks)
            )
        failures = [msg for ok, _n, msg in outcomes if not ok]
        if failures:
            return failures
        nbytes = sum(n for _ok, n, _msg in outcomes)
        seconds = self._clock() - started
        progress = self._progress[name]
        progress.last_step = step
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

    def _promote_shard(
        self, name: TierName, step: int, rank: int, manifest: Manifest
    ) -> tuple[bool, int, str]:
        """(committed, bytes written, failure message) for one shard; never raises."""
        key = (name, step, rank)
        attempts, not_before = self._attempts.get(key, (0, 0.0))
        if attempts >= self.max_attempts:
            return (
                False,
                0,
                f"rank {rank} of step {step} to {name}: gave up after {attempts} attempts",
            )
        if self._clock() < not_before:
            return False, 0, f"rank {rank} of step {step} to {name}: backing off"
        dest = self.durable[name]
        try:
            if self._holds(dest, step, rank, manifest):
                return True, 0, ""
            nbytes = self._copy(name, dest, step, rank, manifest)
            self._verify_copy(dest, step, rank, manifest)
        except Exception as exc:  # one bad shard never stops the engine
            attempts += 1
            self._attempts[key] = (
                attempts,
                self._clock() + self.backoff_seconds * 2 ** (attempts - 1),
            )
            kind: EventKind = "gave_up" if attempts >= self.max_attempts else "failed"
            msg = f"promoting rank {rank} of step {step} to {name} failed ({attempts}/{self.max_attempts}): {exc}"
            log.warning(msg, extra={"event": kind, "tier": name, "step": step, "rank": rank})
            self._emit(PromotionEvent(kind, name, step, (rank,), message=str(exc)))
            return False, 0, msg
        self._attempts.pop(key, None)
        return True, nbytes, ""

    def _holds(self, tier: Tier, step: int, rank: int, manifest: Manifest) -> bool:
        """The tier already holds this exact shard committed (same CRC32C and length)."""
        try:
            current = tier.get_manifest(self.job_id, step, rank)
        except ShardCorrupt as exc:
            self._quarantine(tier, step, rank, str(exc))
            return False
        except ShardUnavailable:
            return False
        return current.crc32c == manifest.crc32c and current.data_nbytes == manifest.data_nbytes

    def _copy(self, name: TierName, dest: Tier, step: int, rank: int, manifest: Manifest) -> int:
        pvc = self.durable.get("pvc")
        if name == "gcs" and isinstance(pvc, PosixTier) and self._holds(pvc, step, rank, manifest):
            try:
                return dest.put_shard(
                    self.job_id, step, rank, pvc.data_path(self.job_id, step, rank), manifest
                )
            except ShardCorrupt as exc:
                # The PVC copy does not match its manifest: quarantine it, fall back to RAM now.
                self._quarantine(pvc, step, rank, str(exc))
        with SlotLease(self.ram, self.job_id, step, rank, timeout=self.lease_timeout) as lease:
            current = lease.manifest
            if current is None or current.crc32c != manifest.crc32c:
                raise ShardUnavailable(
                    f"RAM shard rank {rank} of step {step} changed while being promoted"
                )
            try:
                return dest.put_shard(self.job_id, step, rank, lease.path, current)
            except ShardCorrupt as exc:
                self._quarantine(self.ram, step, rank, str(exc))
                raise

    def _verify_copy(self, dest: Tier, step: int, rank: int, manifest: Manifest) -> None:
        """Check the committed copy; quarantine it and raise ShardCorrupt when it is bad."""
        try:
            if isinstance(dest, PosixTier):
                dest.verify_file(dest.data_path(self.job_id, step, rank), manifest)
            elif hasattr(dest, "verify_shard"):
                dest.verify_shard(self.job_id, step, rank)
        except ShardCorrupt as exc:
            self._quarantine(dest, step, rank, f"verification after copy: {exc}")
            raise

    def _quarantine(self, tier: Tier, step: int, rank: int, reason: str) -> None:
        self._emit(PromotionEvent("checksum_mismatch", tier.name, step, (rank,), message=reason))
        try:
            tier.quarantine(self.job_id, step, rank, reason)
        except TierError as exc:
            log.error("cannot quarantine rank %d of step %d in %s: %s", rank, step, tier.name, exc)

    # -- retention --------------------------------------------------------------------------------

    def _maintain(self, name: TierName, ranks: set[int]) -> list[int]:
        """Retention and GC of one durable tier for ``ranks``; returns the steps touched."""
        if not ranks:
            return []
        tier = self.durable[name]
        try:
            listings = tier.list_steps(self.job_id)
        except TierError as exc:
            log.warning("retention on %s skipped: %s", name, exc)
            return []
        now = self._wall()
        progress = self._progress[name]
        for s in listings:
            progress.first_seen.setdefault(s, now)
        plan = plan_retention(
            listings,
            self.policies[name].retention,
            now=now,
            grace_seconds=self.config.gc_grace_seconds,
            first_seen=progress.first_seen,
        )
        touched: list[int] = []
        for step in plan.prune:
            listing = listings[step]
            mine = frozenset(ranks & (listing.committed_ranks | listing.partial_ranks))
            if mine and self._delete(tier, step, mine, "retention"):
                touched.append(step)
        for step in plan.gc:
            mine = self._gc_ranks(tier, listings[step], ranks)
            if mine and self._delete(tier, step, mine, "gc"):
                touched.append(step)
        gc_objects = getattr(tier, "gc_incomplete", None)
        if gc_objects is not None:
            try:
                gc_objects(self.job_id, self.config.gc_grace_seconds)
            except TierError as exc:
                log.warning("GC of uncommitted objects on %s failed: %s", name, exc)
        for step in list(progress.first_seen):
            if step not in listings:
                del progress.first_seen[step]
        return touched

    def _gc_ranks(self, tier: Tier, listing: StepListing, ranks: set[int]) -> frozenset[int]:
        """Local ranks of an incomplete step that this writer may delete: uncommitted data, and
        committed shards whose manifest names this writer."""
        out = set(ranks & listing.partial_ranks)
        for rank in ranks & listing.committed_ranks:
            try:
                if self.wrote(tier.get_manifest(self.job_id, listing.step, rank).writer_id):
                    out.add(rank)
            except ShardUnavailable:
                continue
        return frozenset(out)

    def wrote(self, writer_id: str) -> bool:
        """Whether a manifest's writer id is this pod's: the sidecar's own id, or one of its
        trainers' (the client stamps ``<pod writer id>/rank-<r>``)."""
        return writer_id == self.writer_id or writer_id.startswith(self.writer_id + "/")

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
        self._emit(PromotionEvent(reason, tier.name, step, tuple(sorted(ranks))))
        return True

    # -- SIGTERM, loop ----------------------------------------------------------------------------

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
        self._stopping.set()
        tier = self.fastest_durable()
        if tier is None:
            return FlushResult(None, None, None, ok=True, message="no durable tier configured")
        lock = self._tier_locks[tier]
        if not lock.acquire(timeout=max(0.0, deadline - self._clock())):
            return FlushResult(
                tier, None, None, ok=False, message=f"deadline passed waiting for the {tier} tier"
            )
        try:
            listing = self.ram_steps()
            ranks = self.local_ranks(listing)
            self._init_tier(tier, ranks)
            step = max(self._ram_steps_of(ranks, listing), default=None)
            durable_step = self._newest_durable_step(tier, ranks)
            if step is None:
                return FlushResult(
                    tier, None, durable_step, ok=True, message="RAM holds no committed step"
                )
            if durable_step is not None and step <= durable_step:
                return FlushResult(
                    tier, step, durable_step, ok=True, message="durable tiers are current"
                )
            failures: list[str] = ["RAM step not promotable"]
            delay = 0.2  # doubled after each failed attempt, up to 2 s (a full PVC stays full)
            while True:
                # Shards that failed earlier may succeed now: the flush ignores their backoff.
                for rank in ranks:
                    self._attempts.pop((tier, step, rank), None)
                manifests = self._ram_manifests(step, ranks, seal=True)
                if manifests is not None:
                    result = RoundResult(ram_step=step)
                    self._promote_if_due(tier, step, manifests, True, result)
                    if result.promoted.get(tier) == step:
                        return FlushResult(tier, step, durable_step, ok=True, message="promoted")
                    failures = result.failed.get(tier, failures)
                remaining = deadline - self._clock()
                if remaining <= 0.2:
                    return FlushResult(
                        tier, step, durable_step, ok=False, message="; ".join(failures)
                    )
                time.sleep(min(delay, remaining - 0.2))
                delay = min(delay * 2, 2.0)
        finally:
            lock.release()

    def _newest_durable_step(self, tier: TierName, ranks: set[int]) -> int | None:
        """Newest step holding every local shard on a durable tier: what this engine promoted
        or found at start, and a fresh listing of ``tier``."""
        known = [p.last_step for p in self._progress.values() if p.last_step is not None]
        try:
            listed = self._newest_local_step(self.durable[tier], ranks)
        except TierError:
            listed = None
        if listed is not None:
            known.append(listed)
        return max(known) if known else None

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

    # -- start-up (C-12) ----------------------------------------------------------------------------

    def prune_ram(self) -> list[tuple[int, int]]:
        """Keep only the newest committed RAM step of each rank; drop everything else.

        Removes older committed steps, partial steps (data links without a manifest, left by a
        writer killed mid-save or OOM-killed, C-12) and stray temporary manifests, and shrinks
        each rank's slot ring back to ``ram.keep + 1`` free-or-used slots. Returns the
        (step, rank) pairs removed. Only this job's directory is touched (hostPath medium).
        """
        removed: list[tuple[int, int]] = []
        listings = self.ram_steps()
        ranks: set[int] = set()
        for listing in listings.values():
            ranks.update(listing.committed_ranks | listing.partial_ranks)
        for rank in sorted(ranks):
            committed = [s for s, li in listings.items() if rank in li.committed_ranks]
            keep = max(committed) if committed else None
            for step, listing in sorted(listings.items()):
                if step == keep or rank not in (listing.committed_ranks | listing.partial_ranks):
                    continue
                self.ram.uncommit(self.job_id, step, rank)
                removed.append((step, rank))
        for step in listings:
            d = self.ram.step_dir(self.job_id, step)
            try:
                for entry in os.scandir(d):
                    if ".tmp-" in entry.name:
                        os.unlink(entry.path)
                d.rmdir()
            except OSError:
                pass
        self._shrink_slot_rings()
        if removed:
            log.info(
                "start-up: pruned %d RAM shards to the newest committed step per rank",
                len(removed),
                extra={"event": "ram_pruned", "removed": removed},
            )
        return removed

    def _shrink_slot_rings(self) -> None:
        slots_root = self.ram.root / self.job_id / "slots"
        try:
            rank_dirs = [e for e in os.scandir(slots_root) if e.is_dir()]
        except FileNotFoundError:
            return
        for entry in rank_dirs:
            if not (entry.name.startswith("rank-") and entry.name[5:].isdigit()):
                continue
            rank = int(entry.name[5:])
            states = self.ram.slot_states(self.job_id, rank)
            free = [s for s in states if not s.steps]
            extra = len(states) - (self.config.ram.keep + 1)
            for s in sorted(free, key=lambda s: s.path.name, reverse=True)[: max(0, extra)]:
                try:
                    s.path.unlink()
                except OSError:
                    continue
                log.info("start-up: removed surplus RAM slot %s", s.path)


@dataclass(frozen=True)
class FlushResult:
    """Outcome of :meth:`PromotionEngine.flush`."""

    tier: TierName | None
    ram_step: int | None
    durable_step: int | None
    """Newest step already on a durable tier before the flush."""
    ok: bool
    message: str
