"""Data-plane scale simulation: tier requests per sidecar and per checkpoint step as the job grows.

Many real :class:`~strata.sidecar.promotion.round.PromotionEngine` instances (one per simulated
node, ``ranks_per_node`` ranks each, each with its own real RAM tier on tmpfs) run in one
process, round-robin (a *round* = every sidecar runs ``promote_once`` once), against one shared
durable tier:

- ``posix``: a real :class:`~strata.tiers.posix.PosixTier` directory;
- ``gcs``: a real :class:`~strata.tiers.gcs.tier.GcsTier` on fake-gcs-server through the real
  google-cloud-storage client, one client per sidecar whose HTTP requests are counted exactly;
- ``memory``: :class:`MemoryTier`, an in-memory tier with the same contract (used for the
  large world sizes, where thousands of sidecars do not fit a small machine's file system or
  emulator).

Every sidecar sees the tier through its own :class:`CountingTier`, which counts the *requests
the tier call costs on an object store* (a listing is one request per page of 1,000 objects, as
GCS ``objects.list``; a manifest or record read is one GET; a shard put is two uploads (data,
then manifest); a delete is one request per object), and the objects each listing returns.
For the ``gcs`` backend the emulator's HTTP requests are also counted per sidecar, so the model
is checked against the real client.

Per checkpoint step the trainer side writes every rank's shard into its node's RAM tier; rounds
run until the step's commit record is in the durable tier (the *commit latency in rounds*) and
one more round. Reported per W: list/get/put/delete requests per sidecar per step (mean, max)
and in total, objects listed, metadata bytes written (manifests, commit records), commit
latency in rounds; and for restore: inventory bytes per rank, the real planner's time for W
inventories, ``commit.json`` size and parse time.

Run: ``python -m bench.scale_data`` (``--quick`` for a small sweep); writes
``bench/results/scale-data.json``. Figures of wall time are taken on whatever machine runs it
(see the JSON's ``host``); request counts do not depend on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.config import StrataConfig, TierName
from strata.errors import ShardCorrupt, ShardUnavailable
from strata.format import layout
from strata.format.commit import StepCommit
from strata.format.crc import chunk_crcs
from strata.format.manifest import Manifest, StorageEntry
from strata.sidecar.promotion.round import PromotionEngine
from strata.tiers import slots as slots_mod
from strata.tiers.base import InPlaceShard, StepListing, Tier, parse_manifest
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.slots import LocalSlotProvider, SlotWriteLock

JOB = "bench.scale"
PAGE = 1000
"""Objects per listing page (GCS objects.list maxResults default)."""
KINDS = ("list", "get", "put", "delete")


# -- counting ------------------------------------------------------------------------------------


@dataclass
class Counts:
    list: int = 0
    get: int = 0
    put: int = 0
    delete: int = 0
    listed: int = 0
    """Objects returned by listings (the metadata server's work on POSIX)."""
    meta_bytes: int = 0
    """Bytes of manifests and records written."""
    read_bytes: int = 0
    """Bytes of records read (commit records, manifests read raw, incarnation records)."""

    def total(self) -> int:
        return self.list + self.get + self.put + self.delete

    def add(self, other: Counts) -> None:
        for k in (*KINDS, "listed", "meta_bytes", "read_bytes"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _pages(n: int) -> int:
    return max(1, math.ceil(n / PAGE))


def _objects(listings: dict[int, StepListing]) -> int:
    return sum(
        len(e.committed_ranks) * 2 + len(e.partial_ranks) + int(e.has_commit)
        for e in listings.values()
    )


class CountingTier(Tier):
    """One sidecar's view of a shared tier: every call forwarded, its object-store cost counted
    (see the module docstring). Methods a tier may add for scoped reads are forwarded too."""

    def __init__(self, inner: Tier) -> None:
        self.inner = inner
        self.name = inner.name
        self.put_checks_written = inner.put_checks_written
        self.c = Counts()
        self._lock = threading.Lock()

    def _n(self, kind: str, n: int = 1, listed: int = 0, meta: int = 0) -> None:
        with self._lock:
            setattr(self.c, kind, getattr(self.c, kind) + n)
            self.c.listed += listed
            self.c.meta_bytes += meta

    def __getattr__(self, attr: str) -> Any:
        # Attributes the concrete tier has beyond the contract (root, bucket_name, ...).
        return getattr(self.inner, attr)

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        out = self.inner.list_steps(job_id)
        n = _objects(out)
        self._n("list", _pages(n), listed=n)
        return out

    def list_step(self, job_id: str, step: int) -> StepListing | None:
        out: StepListing | None = self.inner.list_step(job_id, step)
        n = 0 if out is None else _objects({step: out})
        self._n("list", _pages(n), listed=n)
        return out

    def step_numbers(self, job_id: str) -> list[int]:
        out: list[int] = self.inner.step_numbers(job_id)
        self._n("list", _pages(len(out)), listed=len(out))
        return out

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        self._n("get")
        return self.inner.get_manifest(job_id, step, rank)

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        n = self.inner.put_shard(job_id, step, rank, src_path, manifest, verify_source)
        self._n("put", 2 if n else 0, meta=len(manifest.to_json()) if n else 0)
        return n

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        self._n("get", 2)
        return self.inner.fetch_shard(job_id, step, rank, dst_path, verify)

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        self._n("get", 2)
        return self.inner.verify_shard(job_id, step, rank)

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        # One listing of the step, then one delete per object of the ranks (data + manifest).
        self._n("list")
        self._n("delete", 2 * (len(ranks) if ranks is not None else 1))
        self.inner.delete_step(job_id, step, ranks)

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        self._n("put", 2)
        self._n("delete", 2)
        self.inner.quarantine(job_id, step, rank, reason)

    def data_path(self, job_id: str, step: int, rank: int) -> Path | None:
        return self.inner.data_path(job_id, step, rank)

    def read_in_place(
        self, job_id: str, step: int, rank: int, *, world_size: int | None, verify: bool
    ) -> InPlaceShard | None:
        return self.inner.read_in_place(job_id, step, rank, world_size=world_size, verify=verify)

    def gc_incomplete(self, job_id: str, grace_seconds: float) -> list[str]:
        before = getattr(self.inner, "scans", 0)
        out = self.inner.gc_incomplete(job_id, grace_seconds)
        if isinstance(self.inner, MemoryTier | _GcsLike):
            scanned = getattr(self.inner, "last_scan_objects", 0)
            if getattr(self.inner, "scans", 0) != before:
                self._n("list", _pages(scanned), listed=scanned)
        self._n("delete", len(out))
        return out

    def read_record(self, key: str) -> bytes | None:
        out = self.inner.read_record(key)
        with self._lock:
            self.c.get += 1
            self.c.read_bytes += len(out or b"")
        return out

    def create_record(self, key: str, payload: bytes) -> bool:
        self._n("put", meta=len(payload))
        return self.inner.create_record(key, payload)

    def delete_record(self, key: str) -> None:
        self._n("delete")
        self.inner.delete_record(key)

    def list_records(self, prefix: str) -> list[str]:
        out = self.inner.list_records(prefix)
        self._n("list", _pages(len(out)), listed=len(out))
        return out

    def complete_steps(self, job_id: str) -> list[int]:
        return sorted(s for s, e in self.list_steps(job_id).items() if e.complete)

    def close(self) -> None:
        return None


class _GcsLike:
    """Marker: a tier whose gc_incomplete scans the whole job (GCS, the memory model of it)."""


# -- the in-memory tier ------------------------------------------------------------------------


class MemoryTier(_GcsLike, Tier):
    """A tier in memory with the contract of :class:`Tier` (the GCS tier's semantics: a shard is
    committed when its manifest object exists; records are created only if absent; listings
    show every step with a data object or manifest; ``gc_incomplete`` scans the whole job and
    deletes this writer's uncommitted data in steps older than the newest complete one).
    Thread-safe. Data objects are kept as bytes; manifests as their stored bytes."""

    name: TierName = "gcs"
    put_checks_written = True

    def __init__(self, writer_id: str = "", clock: Callable[[], float] = time.time) -> None:
        self.writer_id = writer_id
        self._clock = clock
        self._lock = threading.RLock()
        # key -> (bytes, mtime, writer)
        self.objects: dict[str, tuple[bytes, float, str]] = {}
        self._parsed: dict[str, Manifest] = {}
        self._steps: dict[str, dict[int, dict[str, str]]] = {}
        """job -> step -> file name -> key (an index of objects under steps/)."""
        self._cache: dict[tuple[str, int], StepListing] = {}
        self._records: dict[str, set[str]] = {}
        """parent key -> names directly under it (list_records without a scan)."""
        self.scans = 0
        self.last_scan_objects = 0

    # bookkeeping
    def _index(self, key: str, add: bool) -> None:
        parts = key.split("/")
        if len(parts) != 4 or parts[1] != "steps":
            return
        job, _, step_dir, fname = parts
        step = layout.parse_step(step_dir)
        if step is None:
            return
        self._cache.pop((job, step), None)
        by_step = self._steps.setdefault(job, {})
        if add:
            by_step.setdefault(step, {})[fname] = key
        else:
            files = by_step.get(step, {})
            files.pop(fname, None)
            if not files:
                by_step.pop(step, None)

    def _put(self, key: str, payload: bytes, writer: str) -> None:
        parent, _, leaf = key.rpartition("/")
        self._records.setdefault(parent, set()).add(leaf)
        self.objects[key] = (payload, self._clock(), writer)
        self._parsed.pop(key, None)
        self._index(key, True)

    def _del(self, key: str) -> None:
        parent, _, leaf = key.rpartition("/")
        self._records.get(parent, set()).discard(leaf)
        if self.objects.pop(key, None) is not None:
            self._parsed.pop(key, None)
            self._index(key, False)

    def _listing(self, job_id: str, step: int) -> StepListing | None:
        cached = self._cache.get((job_id, step))
        if cached is not None:
            return cached
        files = self._steps.get(job_id, {}).get(step)
        if not files:
            return None
        committed: set[int] = set()
        data: set[int] = set()
        mtime = 0.0
        for fname, key in files.items():
            mtime = max(mtime, self.objects[key][1])
            parsed = layout.parse_shard(fname)
            if parsed is None:
                continue
            (committed if parsed[1] == "manifest" else data).add(parsed[0])
        world = None
        if committed:
            with contextlib.suppress(ShardUnavailable, ShardCorrupt):
                world = self.get_manifest(job_id, step, min(committed)).world_size
        out = StepListing(
            step=step,
            committed_ranks=frozenset(committed),
            partial_ranks=frozenset(data - committed),
            world_size=world,
            mtime=mtime or None,
            has_commit=layout.COMMIT_NAME in files,
        )
        if not committed and not data:
            return None
        self._cache[(job_id, step)] = out
        return out

    # the contract
    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        with self._lock:
            out = {}
            for step in sorted(self._steps.get(job_id, {})):
                li = self._listing(job_id, step)
                if li is not None:
                    out[step] = li
            return out

    def list_step(self, job_id: str, step: int) -> StepListing | None:
        with self._lock:
            return self._listing(job_id, step)

    def step_numbers(self, job_id: str) -> list[int]:
        with self._lock:
            return sorted(self._steps.get(job_id, {}))

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        key = layout.manifest_key(job_id, step, rank)
        with self._lock:
            m = self._parsed.get(key)
            if m is not None:
                return m
            obj = self.objects.get(key)
            if obj is None:
                raise ShardUnavailable(f"memory:{key}: not committed")
            m = parse_manifest(obj[0], f"memory:{key}", job_id, step, rank)
            self._parsed[key] = m
            return m

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        with open(src_path, "rb") as f:
            data = f.read(manifest.data_nbytes)
        if verify_source and manifest.crc32c is not None:
            _, whole = chunk_crcs(data, len(data), manifest.chunk_size)
            if whole != manifest.crc32c:
                raise ShardCorrupt(f"{src_path}: does not match its manifest")
        mkey = layout.manifest_key(job_id, step, rank)
        with self._lock:
            if mkey in self.objects:
                return 0
            self._put(layout.data_key(job_id, step, rank), data, manifest.writer_id)
            self._put(mkey, manifest.to_json(), manifest.writer_id)
        return len(data)

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        m = self.get_manifest(job_id, step, rank)
        with self._lock:
            obj = self.objects.get(layout.data_key(job_id, step, rank))
        if obj is None:
            raise ShardUnavailable(f"memory: rank {rank} of step {step} has no data")
        dst_path.write_bytes(obj[0])
        return m

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        m = self.get_manifest(job_id, step, rank)
        with self._lock:
            obj = self.objects.get(layout.data_key(job_id, step, rank))
        if obj is None or len(obj[0]) != m.data_nbytes:
            raise ShardCorrupt(f"memory: rank {rank} of step {step}: data missing or short")
        return m

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        with self._lock:
            files = dict(self._steps.get(job_id, {}).get(step, {}))
            stems = None if ranks is None else {layout.shard_stem(r) for r in ranks}
            mine = [k for f, k in files.items() if stems is None or f.split(".", 1)[0] in stems]
            commit = files.get(layout.COMMIT_NAME)
            if commit is not None and (stems is None or mine):
                self._del(commit)
            for k in sorted(mine, key=lambda k: not k.endswith(".manifest")):
                self._del(k)

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        with self._lock:
            for key in (
                layout.manifest_key(job_id, step, rank),
                layout.data_key(job_id, step, rank),
            ):
                obj = self.objects.get(key)
                if obj is not None:
                    self._put(f"{key}{layout.QUARANTINE_SUFFIX}-0", obj[0], obj[2])
                    self._del(key)

    def gc_incomplete(self, job_id: str, grace_seconds: float) -> list[str]:
        with self._lock:
            self.scans += 1
            self.last_scan_objects = sum(len(f) for f in self._steps.get(job_id, {}).values())
            complete = [s for s, li in self.list_steps(job_id).items() if li.complete]
            if not complete:
                return []
            newest = max(complete)
            out = []
            now = self._clock()
            for step, files in list(self._steps.get(job_id, {}).items()):
                if step >= newest:
                    continue
                committed = {
                    p[0] for f in files if (p := layout.parse_shard(f)) and p[1] == "manifest"
                }
                for fname, key in list(files.items()):
                    p = layout.parse_shard(fname)
                    if p is None or p[1] != "data" or p[0] in committed:
                        continue
                    _payload, mtime, writer = self.objects[key]
                    if now - mtime > grace_seconds and writer.startswith(self.writer_id):
                        self._del(key)
                        out.append(key)
            return out

    def read_record(self, key: str) -> bytes | None:
        with self._lock:
            obj = self.objects.get(key)
            return None if obj is None else obj[0]

    def create_record(self, key: str, payload: bytes) -> bool:
        with self._lock:
            if key in self.objects:
                return False
            self._put(key, bytes(payload), self.writer_id)
            return True

    def delete_record(self, key: str) -> None:
        with self._lock:
            self._del(key)

    def list_records(self, prefix: str) -> list[str]:
        with self._lock:
            return sorted(self._records.get(prefix.rstrip("/"), ()))


# -- GCS: count the real client's HTTP requests --------------------------------------------------


def _classify(method: str, url: str) -> str:
    path = url.split("?", 1)[0]
    if method == "GET" and path.rstrip("/").endswith("/o"):
        return "list"
    if method == "GET":
        return "get"
    if method == "DELETE":
        return "delete"
    return "put"


class HttpCounter:
    """Wraps a storage client's authorized session: counts requests by kind."""

    def __init__(self, client: Any) -> None:
        self.c: Counter[str] = Counter()
        session = client._http
        orig = session.request
        lock = threading.Lock()

        def request(method: str, url: str, *a: Any, **kw: Any) -> Any:
            with lock:
                self.c[_classify(method.upper(), url)] += 1
            return orig(method, url, *a, **kw)

        session.request = request


# -- memory: small RAM slots, peak RSS, /dev/shm use ---------------------------------------------


@contextlib.contextmanager
def shared_commit_parses(size: int = 32) -> Iterator[None]:
    """Parse each distinct commit record once for the whole process while the simulation runs.

    Every sidecar still reads the record (counted, with its bytes) and gets the same frozen
    :class:`StepCommit` the real parser returns; only the repeated parse is shared. Without
    this, N sidecars in one process each parsing an O(W) record is O(N W) CPU and memory here
    (at W=4,096: 3.7 GB RSS, 13x the time of W=1,024), whereas on a real job each sidecar
    parses in its own process: that per-sidecar cost is the restore figures'
    ``commit_json_parse_seconds``."""
    assert "from_bytes" not in StepCommit.__dict__  # inherited from SealedRecord
    parse = StepCommit.from_bytes
    cache: dict[bytes, StepCommit] = {}

    def from_bytes(cls: type[StepCommit], raw: bytes, where: str) -> StepCommit:
        hit = cache.get(raw)
        if hit is None:
            hit = parse(raw, where)
            if len(cache) >= size:
                cache.pop(next(iter(cache)))
            cache[bytes(raw)] = hit
        return hit

    StepCommit.from_bytes = classmethod(from_bytes)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        del StepCommit.from_bytes


@contextlib.contextmanager
def small_slots(nbytes: int) -> Iterator[None]:
    """Round RAM slot files to ``nbytes`` instead of the runtime's whole MiB while the simulation
    runs. The RAM tier is the real one (slots, hard links, manifests on tmpfs); only its slot
    rounding changes, so each simulated rank's ring holds a page instead of ``keep + 1`` MiB
    (at W=16,384 the MiB rounding alone is 32 GiB of tmpfs)."""
    saved = slots_mod.SLOT_ALIGN
    slots_mod.SLOT_ALIGN = nbytes
    try:
        yield
    finally:
        slots_mod.SLOT_ALIGN = saved


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tmpfs_bytes(root: Path) -> int:
    """Bytes ``root``'s files occupy on their file system (allocated blocks, each inode once)."""
    seen: set[int] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


# -- the simulated job ---------------------------------------------------------------------------


def _write_ram(
    ram: RamTier,
    provider: LocalSlotProvider,
    step: int,
    rank: int,
    world: int,
    nbytes: int,
    ranks_per_node: int,
) -> None:
    """Commit a shard in RAM as the client does (slot under lock, manifest last, checksums)."""
    data = (f"s{step}r{rank};".encode() * (nbytes // 6 + 1))[:nbytes]
    crcs, whole = chunk_crcs(data, len(data), 64 * 1024)
    manifest = Manifest(
        job_id=JOB,
        step=step,
        rank=rank,
        world_size=world,
        writer_id=f"node-{rank // ranks_per_node}/rank-{rank}",
        tree={"step": step},
        tensors=[],
        storages=[StorageEntry(offset=0, nbytes=len(data))],
        data_nbytes=len(data),
        chunk_size=64 * 1024,
    )
    with SlotWriteLock.acquire(provider, JOB, rank, len(data)) as slot:
        with open(slot, "r+b") as f:
            f.write(data)
        ram.commit_slot(JOB, step, rank, slot, manifest)
    ram.update_checksums(JOB, step, rank, crcs, whole)


@dataclass
class Node:
    ram: RamTier
    provider: LocalSlotProvider
    ranks: list[int]
    view: CountingTier
    engine: PromotionEngine
    http: HttpCounter | None = None


def _config(ram: Path, node: int, tier: TierName, keep: int, extra: dict[str, Any]) -> StrataConfig:
    raw: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(ram), "every": {"steps": 1}, "keep": 1},
        "writer_id": f"node-{node}",
        "gc_grace_seconds": 0,
        tier: {**extra, "every": {"steps": 1}, "keep": keep},
    }
    return StrataConfig.parse(raw)


def simulate(
    backend: str,
    world: int,
    *,
    ranks_per_node: int,
    steps: int,
    keep: int,
    shard_bytes: int,
    scratch: Path,
    gcs: Any = None,
    shm_budget: int | None = None,
) -> dict[str, Any]:
    """Run ``steps`` checkpoint steps of a job of ``world`` ranks; returns the per-step figures
    of the steps after the first ``keep + 1`` (steady state: retention deletes every step)."""
    n_nodes = world // ranks_per_node
    root = Path(tempfile.mkdtemp(prefix=f"scale-{backend}-{world}-", dir=scratch))
    shm = Path(tempfile.mkdtemp(prefix=f"scale-ram-{world}-", dir="/dev/shm"))
    shared: Tier
    tier_name: TierName
    extra: dict[str, Any]
    bucket = None
    if backend == "posix":
        shared, tier_name, extra = PosixTier(root / "pvc"), "pvc", {"path": str(root / "pvc")}
    elif backend == "memory":
        shared, tier_name, extra = MemoryTier(), "gcs", {"bucket": "memory"}
    else:
        bucket = f"scale-{world}-{os.getpid()}-{int(time.time())}"
        gcs.client().create_bucket(bucket)
        shared, tier_name, extra = None, "gcs", {"bucket": bucket, "endpoint": gcs.endpoint}  # type: ignore[assignment]
    nodes: list[Node] = []
    try:
        for n in range(n_nodes):
            ram_dir = shm / f"node-{n}"
            ram_dir.mkdir()
            ram = RamTier(ram_dir, keep=1)
            provider = LocalSlotProvider(ram, keep=1)
            ranks = list(range(n * ranks_per_node, (n + 1) * ranks_per_node))
            config = _config(ram_dir, n, tier_name, keep, extra)
            http = None
            if backend == "gcs":
                from strata.tiers.gcs.tier import GcsTier

                client = gcs.client()
                http = HttpCounter(client)
                inner: Tier = GcsTier(config.gcs, writer_id=f"node-{n}", client=client)  # type: ignore[arg-type]
            elif backend == "memory":
                assert isinstance(shared, MemoryTier)
                inner = _WriterView(shared, f"node-{n}")
            else:
                inner = shared
            view = CountingTier(inner)
            engine = PromotionEngine(
                config,
                ram,
                {tier_name: view},
                local_ranks=ranks,
                max_workers=1,
                maintenance_seconds=1e9,
                seal_after_seconds=0.0,
            )
            nodes.append(Node(ram, provider, ranks, view, engine, http))
        reader = nodes[0].view.inner
        per_step: list[dict[str, Any]] = []
        shm_peak = 0
        for k in range(1, steps + 1):
            step = k * 10
            for node in nodes:
                for r in node.ranks:
                    _write_ram(node.ram, node.provider, step, r, world, shard_bytes, ranks_per_node)
            shm_peak = max(shm_peak, tmpfs_bytes(shm))
            if shm_budget is not None and shm_peak > shm_budget:
                raise SystemExit(
                    f"Strata bench: the simulated RAM tiers use {shm_peak} bytes of {shm}, over "
                    f"the budget of {shm_budget}; lower --slot-bytes or W, or raise "
                    "--shm-budget-mib"
                )
            before = [_snapshot(node) for node in nodes]
            rounds = 0
            committed_at = None
            started = time.perf_counter()
            while rounds < 6:
                rounds += 1
                for node in nodes:
                    node.engine.promote_once()
                if committed_at is None and reader.read_record(layout.commit_key(JOB, step)):
                    committed_at = rounds
                if committed_at is not None and rounds >= committed_at + 1:
                    break
            seconds = time.perf_counter() - started
            deltas = [_delta(b, _snapshot(node)) for b, node in zip(before, nodes, strict=True)]
            per_step.append(
                {
                    "step": step,
                    "rounds": rounds,
                    "commit_round": committed_at,
                    "seconds": round(seconds, 3),
                    "per_sidecar": deltas,
                }
            )
        steady = per_step[keep + 1 :] or per_step[-1:]
        out = _summarise(steady, n_nodes, world)
        out["complete_steps_left"] = len(
            [s for s, e in reader.list_steps(JOB).items() if e.has_commit]
        )
        out["steps_left"] = sorted(reader.list_steps(JOB))
        out["shm_peak_bytes"] = shm_peak
        out["rss_peak_bytes"] = peak_rss_bytes()
        return out
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        if bucket is not None:
            admin = gcs.client()
            for blob in admin.list_blobs(bucket):
                blob.delete()
            admin.bucket(bucket).delete()


class _WriterView(Tier):
    """A node's handle on the shared :class:`MemoryTier`: records it creates carry its writer id
    and its GC deletes only its own leftovers (as each sidecar's GcsTier has its own writer id)."""

    def __init__(self, shared: MemoryTier, writer_id: str) -> None:
        self.shared = shared
        self.writer_id = writer_id
        self.name = shared.name
        self.put_checks_written = shared.put_checks_written

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.shared, attr)

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        return self.shared.list_steps(job_id)

    def step_numbers(self, job_id: str) -> list[int]:
        return self.shared.step_numbers(job_id)

    def list_step(self, job_id: str, step: int) -> StepListing | None:
        return self.shared.list_step(job_id, step)

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        return self.shared.get_manifest(job_id, step, rank)

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        return self.shared.put_shard(job_id, step, rank, src_path, manifest, verify_source)

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        return self.shared.fetch_shard(job_id, step, rank, dst_path, verify)

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        return self.shared.verify_shard(job_id, step, rank)

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        self.shared.delete_step(job_id, step, ranks)

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        self.shared.quarantine(job_id, step, rank, reason)

    @property
    def scans(self) -> int:
        return self.shared.scans

    @property
    def last_scan_objects(self) -> int:
        return self.shared.last_scan_objects

    def gc_incomplete(self, job_id: str, grace_seconds: float) -> list[str]:
        with self.shared._lock:
            saved = self.shared.writer_id
            self.shared.writer_id = self.writer_id
            try:
                return self.shared.gc_incomplete(job_id, grace_seconds)
            finally:
                self.shared.writer_id = saved

    def read_record(self, key: str) -> bytes | None:
        return self.shared.read_record(key)

    def create_record(self, key: str, payload: bytes) -> bool:
        return self.shared.create_record(key, payload)

    def delete_record(self, key: str) -> None:
        self.shared.delete_record(key)

    def list_records(self, prefix: str) -> list[str]:
        return self.shared.list_records(prefix)


def _snapshot(node: Node) -> dict[str, int]:
    c = node.view.c
    snap = {k: getattr(c, k) for k in (*KINDS, "listed", "meta_bytes", "read_bytes")}
    if node.http is not None:
        snap.update({f"http_{k}": node.http.c[k] for k in KINDS})
    return snap


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in b}


def _summarise(per_step: list[dict[str, Any]], n_nodes: int, world: int) -> dict[str, Any]:
    keys = list(per_step[0]["per_sidecar"][0])
    per_sidecar_mean: dict[str, float] = {}
    per_sidecar_max: dict[str, int] = {}
    total: dict[str, float] = {}
    for k in keys:
        sums = [sum(d[k] for d in s["per_sidecar"]) for s in per_step]
        maxes = [max(d[k] for d in s["per_sidecar"]) for s in per_step]
        total[k] = sum(sums) / len(sums)
        per_sidecar_mean[k] = total[k] / n_nodes
        per_sidecar_max[k] = max(maxes)
    req = sum(per_sidecar_mean[k] for k in KINDS)
    out: dict[str, Any] = {
        "world_size": world,
        "sidecars": n_nodes,
        "requests_per_sidecar": round(req, 2),
        "requests_per_sidecar_max": sum(per_sidecar_max[k] for k in KINDS),
        "requests_total": round(req * n_nodes, 1),
        "by_kind_per_sidecar": {k: round(per_sidecar_mean[k], 2) for k in KINDS},
        "by_kind_total": {k: round(total[k], 1) for k in KINDS},
        "objects_listed_per_sidecar": round(per_sidecar_mean["listed"], 1),
        "metadata_bytes_total": round(total["meta_bytes"]),
        "record_bytes_read_per_sidecar": round(per_sidecar_mean["read_bytes"]),
        "commit_round": [s["commit_round"] for s in per_step],
        "seconds_per_step": [s["seconds"] for s in per_step],
    }
    if "http_list" in keys:
        out["http_per_sidecar"] = {k: round(per_sidecar_mean[f"http_{k}"], 2) for k in KINDS}
        out["http_requests_per_sidecar"] = round(
            sum(per_sidecar_mean[f"http_{k}"] for k in KINDS), 2
        )
    return out


# -- restore: inventories, planner, commit.json ------------------------------------------------


def restore_figures(world: int, keep: int, scratch: Path) -> dict[str, Any]:
    """Inventory bytes per rank, the real planner's time for ``world`` inventories, and the
    size and parse time of a ``world``-rank commit record (built by the real code)."""
    from strata.format.commit import build_commit
    from strata.restore.inventory import collect_inventory
    from strata.restore.plan import RankInventory, plan_restore

    tier = MemoryTier(writer_id="bench")
    src = scratch / f"restore-src-{world}"
    src.write_bytes(b"x" * 64)
    crcs, whole = chunk_crcs(b"x" * 64, 64, 64 * 1024)
    raws: dict[int, tuple[Manifest, bytes]] = {}
    for s in range(keep):
        step = (s + 1) * 10
        for rank in range(world):
            m = Manifest(
                job_id=JOB,
                step=step,
                rank=rank,
                world_size=world,
                writer_id=f"node-{rank // 8}/rank-{rank}",
                tree={"step": step},
                tensors=[],
                storages=[StorageEntry(offset=0, nbytes=64)],
                data_nbytes=64,
                chunk_size=64 * 1024,
                chunk_crc32c=crcs,
                crc32c=whole,
            )
            tier.put_shard(JOB, step, rank, src, m)
            if s == keep - 1:
                raws[rank] = (m, tier.read_record(layout.manifest_key(JOB, step, rank)) or b"")
        commit = build_commit(
            JOB,
            step,
            {
                r: (
                    tier.get_manifest(JOB, step, r),
                    tier.read_record(layout.manifest_key(JOB, step, r)) or b"",
                )
                for r in range(world)
            },
            "bench",
        )
        tier.create_record(layout.commit_key(JOB, step), commit.to_bytes())
    raw = tier.read_record(layout.commit_key(JOB, keep * 10)) or b""
    t0 = time.perf_counter()
    for _ in range(3):
        StepCommit.from_bytes(raw, "bench")
    parse = (time.perf_counter() - t0) / 3
    view = CountingTier(tier)
    t0 = time.perf_counter()
    inv = collect_inventory([view], JOB, 0, world)
    collect = time.perf_counter() - t0
    d = inv.to_dict()
    inv_bytes = len(json.dumps(d).encode())
    # Every rank's inventory lists the whole shared tier, so W parsed inventories are O(W^2)
    # objects (at W=16,384: ~16 GB of frozensets). The planner gets W inventories that share
    # one parsed listing (it only reads them); the parse a rank does of the W gathered
    # inventories is timed on one and multiplied (``gathered_parse_seconds_per_rank``).
    t0 = time.perf_counter()
    base = RankInventory.from_dict(json.loads(json.dumps(d)))
    parse_one = time.perf_counter() - t0
    invs = [dataclasses.replace(base, rank=r) for r in range(world)]
    t0 = time.perf_counter()
    plan = plan_restore(invs, world)
    plan_s = time.perf_counter() - t0
    src.unlink()
    return {
        "world_size": world,
        "inventory_bytes_per_rank": inv_bytes,
        "inventory_all_gather_bytes": inv_bytes * world,
        "inventory_collect_seconds": round(collect, 4),
        "inventory_requests": {k: getattr(view.c, k) for k in KINDS},
        "inventory_parse_seconds": round(parse_one, 5),
        "gathered_parse_seconds_per_rank": round(parse_one * world, 2),
        "plan_seconds": round(plan_s, 4),
        "plan_step": None if plan is None else plan.step,
        "commit_json_bytes": len(raw),
        "commit_json_parse_seconds": round(parse, 4),
    }


# -- driver -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _emulator() -> Iterator[Any]:
    from strata.testing.emulator import FakeGcsServer

    class _Emu:
        def __init__(self, server: FakeGcsServer) -> None:
            self.server = server
            self.endpoint = server.endpoint
            self.clients: list[Any] = []

        def client(self) -> Any:
            c = self.server.client(project="test")
            self.clients.append(c)
            return c

    with FakeGcsServer() as server:
        emu = _Emu(server)
        try:
            yield emu
        finally:
            for c in emu.clients:
                with contextlib.suppress(Exception):
                    c.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/scale-data.json"))
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--shard-bytes", type=int, default=256)
    p.add_argument(
        "--slot-bytes",
        type=int,
        default=4096,
        help="RAM slot rounding in the simulation (the runtime's is 1 MiB; see small_slots)",
    )
    p.add_argument(
        "--shm-budget-mib",
        type=int,
        default=2048,
        help="stop if the simulated RAM tiers use more of /dev/shm than this",
    )
    p.add_argument("--posix", default="64,256,1024", help="world sizes on a real directory")
    p.add_argument("--gcs", default="64,256", help="world sizes on fake-gcs-server")
    p.add_argument("--memory", default="64,256,1024,4096,16384", help="world sizes in memory")
    p.add_argument("--restore", default="1024,4096,16384", help="world sizes for restore figures")
    p.add_argument("--label", default="", help="a name for this run (e.g. before/after)")
    args = p.parse_args(argv)

    def sizes(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    scratch = Path(tempfile.mkdtemp(prefix="scale-data-"))
    runs: dict[str, dict[str, Any]] = {}
    try:
        with small_slots(args.slot_bytes), shared_commit_parses():
            _sweep(args, sizes, scratch, runs)
        restore = {}
        for w in sizes(args.restore):
            restore[str(w)] = rf = restore_figures(w, args.keep, scratch)
            print(
                f"restore W={w:6} inventory/rank={rf['inventory_bytes_per_rank']} B"
                f" (all-gathered {rf['inventory_all_gather_bytes'] / 2**20:.0f} MiB, parsed by"
                f" each rank in ~{rf['gathered_parse_seconds_per_rank']} s)"
                f" plan={rf['plan_seconds']} s commit.json={rf['commit_json_bytes']} B"
                f" parsed in {rf['commit_json_parse_seconds']} s"
                f" rss peak={peak_rss_bytes() / 2**20:.0f} MiB",
                flush=True,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {
        "label": args.label,
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
        },
        "params": {
            "ranks_per_node": args.ranks_per_node,
            "steps": args.steps,
            "keep": args.keep,
            "shard_bytes": args.shard_bytes,
            "slot_bytes": args.slot_bytes,
            "list_page_objects": PAGE,
        },
        # Keyed by W: the in-memory tier where it ran (every W), else the real tier's figure;
        # every backend's figures are under "by_backend".
        "requests_per_sidecar_per_step": _by_world(runs, "requests_per_sidecar"),
        "requests_per_sidecar_max_per_step": _by_world(runs, "requests_per_sidecar_max"),
        "requests_total_per_step": _by_world(runs, "requests_total"),
        "commit_latency_rounds": _by_world(runs, "commit_round"),
        "metadata_bytes_per_step": _by_world(runs, "metadata_bytes_total"),
        "record_bytes_read_per_sidecar_per_step": _by_world(runs, "record_bytes_read_per_sidecar"),
        "shm_peak_bytes": _by_world(runs, "shm_peak_bytes"),
        "rss_peak_bytes": _by_world(runs, "rss_peak_bytes"),
        "by_backend": {
            "requests_per_sidecar_per_step": {
                k: v["requests_per_sidecar"] for k, v in runs.items()
            },
            "requests_total_per_step": {k: v["requests_total"] for k, v in runs.items()},
            "gcs_http_requests_per_sidecar_per_step": {
                k: v["http_requests_per_sidecar"]
                for k, v in runs.items()
                if "http_requests_per_sidecar" in v
            },
        },
        "growth_per_sidecar": _growth(runs),
        "runs": runs,
        "restore": restore,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _sweep(
    args: argparse.Namespace,
    sizes: Callable[[str], list[int]],
    scratch: Path,
    runs: dict[str, dict[str, Any]],
) -> None:
    for w in sizes(args.posix):
        runs[f"posix/{w}"] = _one("posix", w, args, scratch)
    if sizes(args.gcs):
        with _emulator() as emu:
            for w in sizes(args.gcs):
                runs[f"gcs/{w}"] = _one("gcs", w, args, scratch, emu)
    for w in sizes(args.memory):
        runs[f"memory/{w}"] = _one("memory", w, args, scratch)


def _by_world(runs: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in ("posix", "gcs", "memory"):  # later ones win: memory runs at every W
        for k, v in runs.items():
            if k.startswith(backend + "/"):
                out[k.split("/")[1]] = v[key]
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _growth(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per backend: per-sidecar requests at the largest W over those at the smallest."""
    out = {}
    for backend in ("posix", "gcs", "memory"):
        ws = sorted(int(k.split("/")[1]) for k in runs if k.startswith(backend + "/"))
        if len(ws) >= 2:
            lo = runs[f"{backend}/{ws[0]}"]["requests_per_sidecar"]
            hi = runs[f"{backend}/{ws[-1]}"]["requests_per_sidecar"]
            out[f"{backend} {ws[0]}->{ws[-1]}"] = round(hi / lo, 2) if lo else float("inf")
    return out


def _one(
    backend: str, w: int, args: argparse.Namespace, scratch: Path, gcs: Any = None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = simulate(
        backend,
        w,
        ranks_per_node=args.ranks_per_node,
        steps=args.steps,
        keep=args.keep,
        shard_bytes=args.shard_bytes,
        scratch=scratch,
        gcs=gcs,
        shm_budget=args.shm_budget_mib * 1024 * 1024,
    )
    r["wall_seconds"] = round(time.perf_counter() - t0, 1)
    extra = f" http={r['http_requests_per_sidecar']}" if "http_requests_per_sidecar" in r else ""
    print(
        f"{backend:6} W={w:6} N={r['sidecars']:5} req/sidecar/step={r['requests_per_sidecar']:9.1f}"
        f" (max {r['requests_per_sidecar_max']}) total={r['requests_total']:11.0f}"
        f" {r['by_kind_per_sidecar']} listed/sidecar={r['objects_listed_per_sidecar']}"
        f" commit_round={r['commit_round']}{extra}"
        f" read/sidecar={r['record_bytes_read_per_sidecar'] / 1024:.0f} KiB /dev/shm peak={r['shm_peak_bytes'] / 2**20:.1f}"
        f" MiB rss peak={r['rss_peak_bytes'] / 2**20:.0f} MiB [{r['wall_seconds']}s]",
        flush=True,
    )
    return r


if __name__ == "__main__":
    raise SystemExit(main())
