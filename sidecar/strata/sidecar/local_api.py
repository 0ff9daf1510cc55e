"""The trainer-facing local API of the sidecar (JSON over HTTP on a unix socket).

Every request and reply is a message of :mod:`strata.protocol` (the table of endpoints is
there); this module only handles them. Every call names the job; the sidecar refuses any other
job id (it never touches another job's data, which matters on a hostPath RAM medium).

- slots: allocate (``posix_fallocate``: the tmpfs pages are charged to the sidecar's
  container) or reuse a slot file of the rank, the :class:`strata.tiers.slots.SlotProvider`
  contract; 507 ``tier_full`` when the ring would not fit in ``ram.size_limit_bytes`` (or tmpfs
  is full), 409 ``slots_busy``.
- inventory and stage: :func:`strata.restore.collect_inventory` and
  :func:`strata.restore.stage_into_ram` (the same routine the trainer uses without a sidecar);
  404 ``stage_error`` with ``skipped`` when no tier serves.
- report: the client's save/restore events -> metrics and operator reports.
- terminate: the trainer got SIGTERM; start the termination flush now
  (:class:`strata.sidecar.termination.TerminationFlush`) and, with ``wait_step``, answer when
  that step is durable, the flush failed, or ``timeout_seconds`` passed.
- peer (``/v1/peer/*``): this sidecar's peer tier for the trainer's resharding reads
  (:class:`strata.client.peer_source.PeerSource`): listing, sealed manifests and unverified
  ranged reads (raw bytes, at most :data:`strata.peers.wire.MAX_RANGE` each); 404 ``no_peers``
  without a peer tier, 404 ``shard_unavailable`` for a shard no peer serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from strata import protocol as wire
from strata.config import StrataConfig
from strata.errors import ShardCorrupt, ShardUnavailable, SlotsBusy, StageError, TierError, TierFull
from strata.peers.tier import PeerTier
from strata.peers.wire import MAX_RANGE
from strata.reports import FlushEstimate
from strata.restore import collect_inventory, stage_into_ram
from strata.sidecar.http import ApiError, Routes
from strata.sidecar.metrics import Metrics
from strata.sidecar.promotion import PromotionEngine
from strata.sidecar.termination import TerminationFlush
from strata.tiers.base import Tier
from strata.tiers.ram import RamTier
from strata.tiers.slots import LocalSlotProvider, slot_size_for

log = logging.getLogger("strata.sidecar.api")

READER_IDLE_SECONDS = 600.0
"""A peer reader silent this long no longer keeps rebuilt shards (its trainer died without
dropping them: :meth:`LocalApi.peer_drop`)."""


def _parse(model: type[wire.M], request: dict[str, Any]) -> wire.M:
    """The request as its :mod:`strata.protocol` message; 400 ``bad_request`` naming the field."""
    try:
        return wire.parse(model, request, model.__name__)
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc)) from None


class LocalApi:
    """Handlers of the local API; ``routes()`` wires them for :func:`strata.sidecar.http.serve_unix`."""

    def __init__(
        self,
        config: StrataConfig,
        ram: RamTier,
        tiers: Callable[[], list[Tier]],
        engine: PromotionEngine,
        metrics: Metrics,
        on_client_event: Callable[[wire.SaveEvent | wire.RestoreEvent], None],
        is_ready: Callable[[], bool],
        termination: TerminationFlush | None = None,
        flush_estimate: Callable[[], FlushEstimate] | None = None,
    ) -> None:
        self.config = config
        self.ram = ram
        self.tiers = tiers
        self.engine = engine
        self.metrics = metrics
        self.slots = LocalSlotProvider(ram, keep=config.ram.keep)
        self.on_client_event = on_client_event
        self.is_ready = is_ready
        self.termination = termination or TerminationFlush(
            engine, config.termination_grace_seconds, 0.0
        )
        self.flush_estimate = flush_estimate
        self._alloc_lock = threading.Lock()
        self._stage_locks: dict[int, threading.Lock] = {}
        self._peer_readers: dict[str, float] = {}
        """Peer readers (PeerRangeRequest.reader) -> when last seen (monotonic seconds), since
        the rebuilt shards were last removed (:meth:`peer_drop`)."""
        self._peer_readers_lock = threading.Lock()
        """Guards ``_peer_readers`` and the removal of rebuilt shards (no read registers while
        they are being removed)."""

    def routes(self) -> Routes:
        routes = Routes()
        routes.add(*wire.HEALTHZ, self.healthz)
        routes.add(*wire.SLOTS, self.acquire_slot)
        routes.add(*wire.INVENTORY, self.inventory)
        routes.add("GET", wire.INVENTORY.path, self.inventory)
        routes.add(*wire.STAGE, self.stage)
        routes.add(*wire.REPORT, self.report)
        routes.add(*wire.STATUS, self.status)
        routes.add(*wire.TERMINATE, self.terminate)
        routes.add(*wire.PEER, self.peer_info)
        routes.add(*wire.PEER_STEPS, self.peer_steps)
        routes.add(*wire.PEER_MANIFEST, self.peer_manifest)
        routes.add_bytes(*wire.PEER_RANGE, self.peer_range)
        routes.add(*wire.PEER_DROP, self.peer_drop)
        return routes

    def _job(self, request: dict[str, Any]) -> str:
        job = request.get("job_id")
        if not isinstance(job, str) or job != self.config.job_id:
            raise ApiError(
                403,
                "wrong_job",
                f"this sidecar serves job {self.config.job_id!r}, not {job!r}; the trainer and "
                "the sidecar must share STRATA_CONFIG / STRATA_JOB_ID",
            )
        return job

    # -- endpoints --------------------------------------------------------------------------------

    def healthz(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ready = self.is_ready()
        return (200 if ready else 503), wire.HealthReply(ready=ready).model_dump(mode="json")

    def acquire_slot(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = self._job(request)
        msg = _parse(wire.SlotRequest, request)
        rank, nbytes = msg.rank, msg.nbytes
        exclude = [Path(p) for p in msg.exclude]
        self.engine.add_ranks([rank])
        with self._alloc_lock:
            self._check_fits(job, rank, nbytes)
            try:
                path = self.slots.acquire_slot(job, rank, nbytes, exclude)
            except TierFull as exc:
                raise ApiError(507, "tier_full", str(exc)) from None
            except SlotsBusy as exc:
                raise ApiError(409, "slots_busy", str(exc)) from None
        return 200, wire.SlotReply(path=str(path)).model_dump(mode="json")

    def _check_fits(self, job: str, rank: int, nbytes: int) -> None:
        """Refuse a slot ring that would not fit in ``ram.size_limit_bytes`` (clear message)."""
        limit = self.config.ram.size_limit_bytes
        if limit is None:
            return
        sizes = self.ram.slot_sizes(job)
        own = sizes.pop(rank, [])
        used_other = sum(sum(s) for s in sizes.values())
        ring = self.config.ram.keep + 1
        want = slot_size_for(nbytes)
        # The ring of this rank after the request: at least keep+1 slots of at least `want`.
        own_after = sum(max(s, want) for s in own[:ring]) + max(0, ring - len(own)) * want
        own_after += sum(own[ring:])
        if used_other + own_after > limit:
            raise ApiError(
                507,
                "tier_full",
                f"rank {rank}'s checkpoint of {nbytes} bytes needs a ring of {ring} slots of "
                f"{want} bytes (ram.keep={self.config.ram.keep} + 1); with the {used_other} bytes "
                f"of other local ranks' slots that is {used_other + own_after} bytes, more than "
                f"the RAM tier's size limit ram.size_limit_bytes={limit}. Raise the policy's "
                "spec.tiers.ram.sizeLimit, lower ram.keep, or shrink the state",
            )

    def inventory(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = self._job(request)
        msg = _parse(wire.InventoryRequest, request)
        self.engine.add_ranks([msg.rank])
        inv = collect_inventory(self.tiers(), job, msg.rank, msg.world_size)
        return 200, wire.InventoryReply.of(inv).model_dump(mode="json")

    def _rank_lock(self, rank: int) -> threading.Lock:
        with self._alloc_lock:
            return self._stage_locks.setdefault(rank, threading.Lock())

    def stage(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Stage one shard; stagings of one rank are serialised (a prefetch and the trainer's
        restore of the same shard never copy it twice into two slots)."""
        job = self._job(request)
        msg = _parse(wire.StageRequest, request)
        self.engine.add_ranks([msg.rank])
        with self._rank_lock(msg.rank):
            return self._stage(job, msg)

    def _stage(self, job: str, msg: wire.StageRequest) -> tuple[int, dict[str, Any]]:
        rank, step = msg.rank, msg.step
        t0 = time.perf_counter()
        try:
            res = stage_into_ram(
                self.tiers(),
                self.ram,
                self.slots,
                job,
                step,
                rank,
                world_size=msg.world_size,
                verify=self.config.restore.verify,
                sources=msg.sources,
                before_allocate=lambda nbytes: self._check_fits(job, rank, nbytes),
                # The trainer may verify a RAM hit while loading it (one pass, not two).
                verify_in_place=None if msg.verify_in_place else False,
            )
        except StageError as exc:
            self._count_quarantines(exc.quarantined)
            self.metrics.stage_total.labels(tier="none", outcome="failed").inc()
            raise ApiError(
                404,
                "stage_error",
                str(exc),
                {"skipped": exc.skipped, "quarantined": exc.quarantined},
            ) from None
        except TierError as exc:
            raise ApiError(
                507 if isinstance(exc, TierFull) else 500, "tier_error", str(exc)
            ) from None
        seconds = time.perf_counter() - t0
        self._count_quarantines(res.quarantined)
        self.metrics.stage_total.labels(tier=res.tier, outcome="staged").inc()
        self.metrics.stage_duration.labels(tier=res.tier).observe(seconds)
        log.info(
            "staged rank %d of step %d from %s (%d bytes, %.3fs)",
            rank,
            step,
            res.tier,
            res.nbytes,
            seconds,
            extra={
                "event": "staged",
                "tier": res.tier,
                "step": step,
                "rank": rank,
                "skipped": res.skipped,
            },
        )
        return 200, wire.StageReply.of(res).model_dump(mode="json")

    def _count_quarantines(self, tiers: Sequence[str]) -> None:
        for tier in tiers:
            self.metrics.checksum_mismatches.labels(tier=tier).inc()

    def report(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._job(request)
        try:
            event = wire.parse_event(request)
        except ValueError as exc:
            raise ApiError(400, "bad_request", str(exc)) from None
        if isinstance(event, wire.SaveEvent) and event.ok and event.stall_seconds is not None:
            self.metrics.save_stall.observe(event.stall_seconds)
        if event.rank is not None:
            self.engine.add_ranks([event.rank])
        self.on_client_event(event)
        return 200, wire.ReportReply(accepted=True).model_dump(mode="json")

    def status(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ranks = self.engine.local_ranks()
        reply = wire.StatusReply(
            job_id=self.config.job_id,
            ready=self.is_ready(),
            local_ranks=sorted(ranks),
            ram_step=self.engine.newest_ram_step(ranks),
            promoted={str(t): s for t, s in self.engine.last_promoted().items()},
            flush_estimate=(
                self.flush_estimate().model_dump(mode="json") if self.flush_estimate else None
            ),
        )
        return 200, reply.model_dump(mode="json")

    def terminate(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The trainer's termination notice (and, with ``wait_step``, its wait for the flush)."""
        self._job(request)
        msg = _parse(wire.TerminateRequest, request)
        self.engine.add_ranks([msg.rank])
        deadline = self.termination.notice(
            msg.since_signal_seconds, hold=msg.final_save and msg.wait_step is None
        )
        if msg.wait_step is not None:
            self.termination.wait(
                msg.wait_step, min(msg.timeout_seconds, deadline - time.monotonic())
            )
        last = self.termination.last
        started, done = self.termination.state()
        reply = wire.TerminateReply(
            started=started,
            done=done,
            ok=None if last is None else last.result.ok,
            fit=None if last is None else last.fit,
            tier=None if last is None else last.result.tier,
            durable_step=None if last is None else last.durable_step,
            seconds=None if last is None else last.seconds,
            deadline_in_seconds=max(0.0, deadline - time.monotonic()),
            message="" if last is None else last.result.message,
        )
        return 200, reply.model_dump(mode="json")

    # -- the peer tier, for the trainer's resharding reads (strata.client.peer_source) ----------

    _peer_listing = threading.Lock()
    """One peer listing at a time (it refreshes the peer tier's view of every peer)."""

    def _peer_tier(self) -> PeerTier:
        """This sidecar's peer tier; 404 ``no_peers`` when it has none."""
        for tier in self.tiers():
            if isinstance(tier, PeerTier):
                return tier
        raise ApiError(
            404,
            "no_peers",
            f"the sidecar of job {self.config.job_id!r} has no peer tier (peers are not "
            "configured for this pod); restore from RAM, the PVC or GCS",
        )

    def peer_info(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        enabled = any(isinstance(t, PeerTier) for t in self.tiers())
        reply = wire.PeerInfoReply(enabled=enabled, max_range=MAX_RANGE)
        return 200, reply.model_dump(mode="json")

    def peer_steps(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = self._job(request)
        tier = self._peer_tier()
        with self._peer_listing:
            try:
                listing = tier.list_steps(job)
            except TierError as exc:
                raise ApiError(500, "tier_error", f"peer listing: {exc}") from None
            notes = list(tier.notes)
        steps = [
            wire.PeerStep(
                step=s, committed_ranks=sorted(e.committed_ranks), world_size=e.world_size
            )
            for s, e in sorted(listing.items())
        ]
        return 200, wire.PeerStepsReply(steps=steps, notes=notes).model_dump(mode="json")

    def peer_manifest(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = self._job(request)
        msg = _parse(wire.PeerShardRequest, request)
        tier = self._peer_tier()
        try:
            m = tier.get_manifest(job, msg.step, msg.rank)
        except TierError as exc:
            raise _peer_error(exc) from None
        reply = wire.PeerManifestReply(manifest=m.to_json().decode())
        return 200, reply.model_dump(mode="json")

    def peer_range(self, request: dict[str, Any]) -> bytes:
        """The bytes of a ranged read of a peer copy (:meth:`PeerTier.read_range`: ranged GETs
        of a peer's copy, or a shard rebuilt from parity), unverified: the trainer checks them
        against the manifest. 400 for a range longer than :data:`MAX_RANGE`."""
        job = self._job(request)
        msg = _parse(wire.PeerRangeRequest, request)
        if msg.length > MAX_RANGE:
            raise ApiError(
                400,
                "bad_request",
                f"a peer range of {msg.length} bytes is more than the {MAX_RANGE} bytes one "
                "request serves (GET /v1/peer: max_range); ask in pieces",
            )
        tier = self._peer_tier()
        if msg.reader:
            with self._peer_readers_lock:
                self._peer_readers[msg.reader] = time.monotonic()
        try:
            return tier.read_range(job, msg.step, msg.rank, msg.offset, msg.length)
        except TierError as exc:
            raise _peer_error(exc) from None

    def peer_drop(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A reader is done: remove the shards the peer tier rebuilt whole to serve ranged reads
        once no other reader of this node still uses them (every reader that read since the
        last removal dropped, or was silent for :data:`READER_IDLE_SECONDS`: a trainer that
        died without dropping). A drop naming no reader (an older client) removes them now."""
        self._job(request)
        msg = _parse(wire.PeerDropRequest, request)
        tier = self._peer_tier()
        with self._peer_readers_lock:
            readers = self._peer_readers
            readers.pop(msg.reader, None)
            idle = time.monotonic() - READER_IDLE_SECONDS
            for reader in [r for r, seen in readers.items() if seen < idle]:
                del readers[reader]
            if msg.reader and readers:
                log.info(
                    "peer drop by %s deferred: %d readers still read", msg.reader, len(readers)
                )
            else:
                readers.clear()
                tier.drop_fetched()
        return 200, wire.ReportReply(accepted=True).model_dump(mode="json")


def _peer_error(exc: TierError) -> ApiError:
    """404 ``shard_unavailable`` for a shard no peer serves (or serves corrupt: the trainer
    falls back to the next source), 500 ``tier_error`` otherwise."""
    if isinstance(exc, (ShardUnavailable, ShardCorrupt)):
        return ApiError(404, "shard_unavailable", f"peer: {exc}")
    return ApiError(500, "tier_error", f"peer: {exc}")
