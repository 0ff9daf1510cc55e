"""The trainer-facing local API of the sidecar (JSON over HTTP on a unix socket).

All bodies are JSON objects. Every call names the job; the sidecar refuses any other job id
(it never touches another job's data, which matters on a hostPath RAM medium).

``GET  /healthz``
    ``{"ready": true}`` (200) once start-up is done; 503 before.
``POST /v1/slots``      ``{"job_id", "rank", "nbytes", "exclude": [paths]}``
    Allocate (``posix_fallocate``: the tmpfs pages are charged to the sidecar's container) or
    reuse a slot file of rank ``rank`` holding at least ``nbytes``; answers ``{"path"}``.
    The :class:`strata.tiers.ram.SlotProvider` contract: a slot no committed step references,
    evicting only steps beyond ``ram.keep``. Errors: 507 ``tier_full`` when the ring would not
    fit in ``ram.size_limit_bytes`` (or tmpfs is full), 409 ``slots_busy``.
``POST /v1/inventory``  ``{"job_id", "rank", "world_size"}``
    :class:`strata.restore.RankInventory` as a dict: committed and partial shards per tier
    (RAM, PVC, GCS in restore order).
``POST /v1/stage``      ``{"job_id", "step", "rank", "world_size", "sources": [tiers] | null}``
    Bring the shard into RAM from the nearest tier that verifies (RAM hit, PVC, GCS; a corrupt
    copy is quarantined, C-04) and commit it there; answers ``{"tier", "path", "manifest",
    "nbytes", "seconds", "skipped"}``. 404 ``stage_error`` with ``skipped`` when no tier serves.
``POST /v1/report``     ``{"kind": "save" | "restore", ...}``
    The client's events: ``save`` (``step``, ``stall_seconds``, ``ok``, ``error``) and
    ``restore`` (``step``, ``tier``, ``seconds``, ``nbytes``, ``outcome``, ``skipped``).
``GET  /v1/status``
    The engine's view: local ranks, newest RAM step, newest promoted step per tier.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from strata.agent.http import ApiError, Routes
from strata.agent.metrics import Metrics
from strata.config import SidecarConfig
from strata.promotion import PromotionEngine
from strata.restore import StageError, StageResult, collect_inventory, stage_shard
from strata.tiers.base import Tier, TierError, TierFull
from strata.tiers.ram import LocalSlotProvider, RamTier, SlotsBusy, SlotWriteLock, slot_size_for

log = logging.getLogger("strata.agent.api")


def _int(request: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = request.get(key)
    try:
        out = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ApiError(400, "bad_request", f"{key} must be an integer, got {value!r}") from None
    if out < minimum:
        raise ApiError(400, "bad_request", f"{key} must be >= {minimum}, got {out}")
    return out


def quarantined_tiers(skipped: Sequence[str]) -> list[str]:
    """Tiers named by ``'<tier>: ... (quarantined)'`` notes of :func:`strata.restore.stage_shard`."""
    return [note.split(":", 1)[0] for note in skipped if note.endswith("(quarantined)")]


class LocalApi:
    """Handlers of the local API; ``routes()`` wires them for :func:`strata.agent.http.serve_unix`."""

    def __init__(
        self,
        config: SidecarConfig,
        ram: RamTier,
        tiers: Callable[[], list[Tier]],
        engine: PromotionEngine,
        metrics: Metrics,
        on_client_event: Callable[[dict[str, Any]], None],
        is_ready: Callable[[], bool],
    ) -> None:
        self.config = config
        self.ram = ram
        self.tiers = tiers
        self.engine = engine
        self.metrics = metrics
        self.slots = LocalSlotProvider(ram, keep=config.ram.keep)
        self.on_client_event = on_client_event
        self.is_ready = is_ready
        self._alloc_lock = threading.Lock()
        self._stage_locks: dict[int, threading.Lock] = {}

    def routes(self) -> Routes:
        routes = Routes()
        routes.add("GET", "/healthz", self.healthz)
        routes.add("POST", "/v1/slots", self.acquire_slot)
        routes.add("POST", "/v1/inventory", self.inventory)
        routes.add("GET", "/v1/inventory", self.inventory)
        routes.add("POST", "/v1/stage", self.stage)
        routes.add("POST", "/v1/report", self.report)
        routes.add("GET", "/v1/status", self.status)
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
        return (200 if ready else 503), {"ready": ready}

    def acquire_slot(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = self._job(request)
        rank = _int(request, "rank")
        nbytes = _int(request, "nbytes")
        exclude = [Path(p) for p in request.get("exclude") or []]
        self.engine.add_ranks([rank])
        with self._alloc_lock:
            self._check_fits(job, rank, nbytes)
            try:
                path = self.slots.acquire_slot(job, rank, nbytes, exclude)
            except TierFull as exc:
                raise ApiError(507, "tier_full", str(exc)) from None
            except SlotsBusy as exc:
                raise ApiError(409, "slots_busy", str(exc)) from None
        return 200, {"path": str(path)}

    def _check_fits(self, job: str, rank: int, nbytes: int) -> None:
        """Refuse a slot ring that would not fit in ``ram.size_limit_bytes`` (clear message)."""
        limit = self.config.ram.size_limit_bytes
        if limit is None:
            return
        slots_root = self.ram.root / job / "slots"
        used_other = 0
        own: list[int] = []
        try:
            for rank_dir in os.scandir(slots_root):
                for slot in os.scandir(rank_dir.path):
                    size = slot.stat().st_size
                    if rank_dir.name == f"rank-{rank:05d}":
                        own.append(size)
                    else:
                        used_other += size
        except FileNotFoundError:
            pass
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
        rank = _int(request, "rank")
        world = _int(request, "world_size", 1)
        self.engine.add_ranks([rank])
        inv = collect_inventory(self.tiers(), job, rank, world)
        return 200, inv.to_dict()

    def _rank_lock(self, rank: int) -> threading.Lock:
        with self._alloc_lock:
            return self._stage_locks.setdefault(rank, threading.Lock())

    def stage(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Stage one shard; stagings of one rank are serialised (a prefetch and the trainer's
        restore of the same shard never copy it twice into two slots)."""
        job = self._job(request)
        rank = _int(request, "rank")
        step = _int(request, "step")
        world = _int(request, "world_size", 1)
        sources = request.get("sources")
        self.engine.add_ranks([rank])
        with self._rank_lock(rank):
            return self._stage(job, rank, step, world, sources)

    def _stage(
        self, job: str, rank: int, step: int, world: int, sources: list[str] | None
    ) -> tuple[int, dict[str, Any]]:
        tiers = [t for t in self.tiers() if sources is None or t.name in sources]
        t0 = time.perf_counter()
        locks: list[SlotWriteLock] = []

        def slot_for(nbytes: int) -> Path:
            self._check_fits(job, rank, nbytes)
            lock = SlotWriteLock.acquire(self.slots, job, rank, nbytes)
            locks.append(lock)
            return lock.path

        try:
            try:
                res = stage_shard(
                    tiers,
                    job,
                    step,
                    rank,
                    slot_for,
                    world_size=world,
                    verify=self.config.restore.verify,
                )
            except StageError as exc:
                self._count_quarantines(exc.skipped)
                self.metrics.stage_total.labels(tier="none", outcome="failed").inc()
                raise ApiError(404, "stage_error", str(exc), {"skipped": exc.skipped}) from None
            if res.tier != self.ram.name:
                self.ram.commit_slot(job, step, rank, res.path, res.manifest)
                res.path = self.ram.data_path(job, step, rank)
        except TierError as exc:
            raise ApiError(
                507 if isinstance(exc, TierFull) else 500, "tier_error", str(exc)
            ) from None
        finally:
            for lock in locks:
                lock.release()
        seconds = time.perf_counter() - t0
        self._count_quarantines(res.skipped)
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
        return 200, stage_result_to_dict(res)

    def _count_quarantines(self, skipped: Sequence[str]) -> None:
        for tier in quarantined_tiers(skipped):
            self.metrics.checksum_mismatches.labels(tier=tier).inc()

    def report(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self._job(request)
        kind = request.get("kind")
        if kind not in ("save", "restore"):
            raise ApiError(400, "bad_request", f"kind must be 'save' or 'restore', got {kind!r}")
        if kind == "save" and request.get("ok", True) and request.get("stall_seconds") is not None:
            self.metrics.save_stall.observe(float(request["stall_seconds"]))
        if "rank" in request:
            self.engine.add_ranks([_int(request, "rank")])
        self.on_client_event(dict(request))
        return 200, {"accepted": True}

    def status(self, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ranks = self.engine.local_ranks()
        return 200, {
            "job_id": self.config.job_id,
            "ready": self.is_ready(),
            "local_ranks": sorted(ranks),
            "ram_step": self.engine.newest_ram_step(ranks),
            "promoted": self.engine.last_promoted(),
        }


def stage_result_to_dict(res: StageResult) -> dict[str, Any]:
    return {
        "tier": res.tier,
        "path": str(res.path),
        "manifest": res.manifest.model_dump(mode="json"),
        "nbytes": res.nbytes,
        "seconds": res.seconds,
        "skipped": list(res.skipped),
    }
