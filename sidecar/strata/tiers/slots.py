"""The RAM tier's slot ring: pre-faulted slot files per rank, their allocation and their locks.

Why and how: see :mod:`strata.tiers.ram`. Paths come from :mod:`strata.format.layout`
(``<job>/slots/rank-RRRRR/slot-K``). :class:`SlotProvider` is the allocation contract (in
process: :class:`LocalSlotProvider`; the sidecar serves it over its socket), :class:`SlotLease`
the readers' shared lock, :class:`SlotWriteLock` the writer's exclusive lock, :class:`SlotMaps`
the writer's persistent mappings.

Ownership across restarts (docs/architecture.md "RAM tier and the training stall"):

- **Writing** a slot needs ``flock(LOCK_EX)`` on it (:class:`SlotWriteLock`); reading needs
  ``LOCK_SH`` (:class:`SlotLease`). Both die with their process, so a restarted trainer or
  sidecar never inherits a stale lock.
- **Mapping** a slot is proven by a *mapping lease*: an open-file-description (OFD) read lock on
  one byte far beyond the end of the slot (:data:`MAP_LEASE_OFFSET`), held by the mapping's own
  file descriptor for the life of the mapping (:func:`mapped_elsewhere` tests it). It does not
  interact with the flock locks and dies with the process too.
- **Deleting** a slot file (start-up pruning of a grown ring) needs ``LOCK_EX`` and no mapping
  lease (:func:`remove_slot_if_unused`); nothing ever shrinks a slot below the size it had when
  someone mapped it (slots only grow, under ``LOCK_EX``).
- **Identity**: the writer maps the inode it holds ``LOCK_EX`` on (checked by ``(st_dev,
  st_ino)`` against the slot's path), and commit checks that the step's data link is that same
  inode before and after the manifest is written (:meth:`strata.tiers.ram.RamTier.commit_slot`):
  the trainer never writes through a mapping of a file that is no longer the slot, and a save
  whose data link was removed under it fails instead of reporting success.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from strata.errors import ShardUnavailable, SlotsBusy, StrataError, TierError, TierFull
from strata.format import layout
from strata.format.manifest import Manifest
from strata.tiers.posix_io import remove_quietly

if TYPE_CHECKING:
    from strata.tiers.ram import RamTier


log = logging.getLogger(__name__)

SLOT_ALIGN = 1024 * 1024
"""Slot sizes are rounded up to whole MiB (fewer regrowths for states that vary a little)."""


class SlotAllocationNeeded(StrataError):
    """A reuse-only provider found no free slot large enough: a slot must be allocated."""


def slots_dir(root: Path, job_id: str, rank: int) -> Path:
    """``<root>/<job>/slots/rank-RRRRR``: the slot files of one rank."""
    return root / layout.rank_slots_key(job_id, rank)


def slot_ranks_in(root: Path, job_id: str) -> dict[int, Path]:
    """Ranks with a slot directory under ``<root>/<job>/slots``, with that directory."""
    out: dict[int, Path] = {}
    try:
        entries = list(os.scandir(root / layout.slots_prefix(job_id)))
    except FileNotFoundError:
        return out
    for entry in entries:
        rank = layout.parse_rank_dir(entry.name)
        if rank is not None and entry.is_dir():
            out[rank] = Path(entry.path)
    return out


def slot_size_for(nbytes: int) -> int:
    """Size of a slot able to hold ``nbytes`` (whole MiB, at least 1 MiB)."""
    return max(SLOT_ALIGN, -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)


def preallocate(path: Path, size: int) -> None:
    """Create or grow ``path`` to ``size`` bytes with every page allocated (tmpfs: charged now).

    ENOSPC raises :class:`TierFull` naming the path; a file this call created is removed and a
    grown file is shrunk back, so a full tmpfs never leaves a half-allocated slot behind.
    """
    existed = path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        old = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if existed:
                os.ftruncate(fd, old)
            else:
                remove_quietly(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(
                    f"no space left on the RAM tier for a {size}-byte slot {path}; raise the "
                    "RAM tier size limit (emptyDir sizeLimit) or lower ram.keep"
                ) from exc
            raise TierError(f"cannot allocate RAM slot {path} ({exc.strerror})") from exc
    finally:
        os.close(fd)


def _try_lock(path: Path, how: int) -> int | None:
    """Open ``path`` and take ``flock(how | LOCK_NB)``; the fd, or None when it is held."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


Identity = tuple[int, int]
"""``(st_dev, st_ino)`` of a slot file: which inode a path or a descriptor names."""


def identity_of(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def path_identity(path: Path) -> Identity | None:
    """The identity of the file at ``path`` now (None: no such file)."""
    try:
        return identity_of(os.stat(path))
    except FileNotFoundError:
        return None


MAP_LEASE_OFFSET = 1 << 62
"""Byte offset of the mapping lease (an OFD lock beyond any slot's end; locks past EOF are
allowed and cost nothing)."""
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = "hhqqi4x"
"""struct flock on 64-bit Linux: l_type, l_whence, (pad), l_start, l_len, l_pid, (pad)."""


def _ofd_lock(fd: int, kind: int) -> bool:
    """Take (or with F_UNLCK drop) an OFD lock of ``kind`` on the mapping-lease byte without
    waiting; False when another open file description holds a conflicting one."""
    arg = struct.pack(_FLOCK, kind, os.SEEK_SET, MAP_LEASE_OFFSET, 1, 0)
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, arg)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def take_mapping_lease(fd: int) -> None:
    """Declare that the mapping made from ``fd``'s file lives as long as ``fd`` stays open."""
    if not _ofd_lock(fd, fcntl.F_RDLCK):
        raise TierError("a RAM slot is being deleted while it is mapped; retry the save")


def mapped_elsewhere(fd: int) -> bool:
    """Whether some live process holds a mapping lease on ``fd``'s file."""
    arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, MAP_LEASE_OFFSET, 1, 0)
    res = fcntl.fcntl(fd, _F_OFD_GETLK, arg)
    return bool(struct.unpack(_FLOCK, res)[0] != fcntl.F_UNLCK)


def remove_slot_if_unused(path: Path) -> bool:
    """Delete the slot file ``path`` only when nobody writes, reads or maps it; True if deleted.

    Takes ``LOCK_EX | LOCK_NB`` (no writer, no reader) and then the mapping-lease byte for
    writing (no live mapping); a slot that is linked as a step's data is never deleted.
    """
    fd = _try_lock(path, fcntl.LOCK_EX)
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if st.st_nlink != 1 or path_identity(path) != identity_of(st):
            return False
        if not _ofd_lock(fd, fcntl.F_WRLCK):
            return False
        os.unlink(path)
        return True
    finally:
        _unlock(fd)


class SlotProvider(Protocol):
    """Hands out RAM slots to the writer of one rank.

    ``acquire_slot(job_id, rank, nbytes, exclude)`` returns the path of a slot file of at least
    ``nbytes`` bytes that no committed step references, pre-allocated, and not in ``exclude``
    (slots the caller failed to lock). To free one it may un-commit the oldest RAM step of that
    rank beyond ``keep``, never the newest committed step and never a slot it cannot lock
    (LOCK_EX|LOCK_NB: a reader holds it). The caller then takes ``LOCK_EX`` itself and retries
    with a longer ``exclude`` when that fails. Raises :class:`TierFull` (ENOSPC) or
    :class:`SlotsBusy`.
    """

    def acquire_slot(
        self, job_id: str, rank: int, nbytes: int, exclude: Collection[Path] = ()
    ) -> Path: ...


@dataclass
class SlotState:
    path: Path
    size: int
    steps: list[tuple[int, bool]]
    """(step, committed) of every step whose data links to this slot."""


class LocalSlotProvider:
    """In-process :class:`SlotProvider` over a :class:`RamTier`.

    ``keep``: committed RAM steps per rank that must survive an allocation (config ram.keep).
    The ring starts with ``keep + 1`` slots and grows up to ``max_slots`` (default ``keep + 3``)
    while slots are leased by readers; beyond that :class:`SlotsBusy` is raised.
    """

    def __init__(
        self, tier: RamTier, keep: int = 1, max_slots: int | None = None, allocate: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.tier = tier
        self.keep = keep
        self.allocate = allocate
        """False: only reuse existing slots of sufficient size; raise
        :class:`SlotAllocationNeeded` instead of creating or growing one (the sidecar does that,
        so its container is charged for the pages)."""
        self.min_slots = keep + 1
        self.max_slots = max(max_slots if max_slots is not None else keep + 3, self.min_slots)
        self._lock = threading.Lock()

    def acquire_slot(
        self, job_id: str, rank: int, nbytes: int, exclude: Collection[Path] = ()
    ) -> Path:
        with self._lock:
            return self._acquire(job_id, rank, nbytes, {Path(p) for p in exclude})

    def _acquire(self, job_id: str, rank: int, nbytes: int, exclude: set[Path]) -> Path:
        d = slots_dir(self.tier.root, job_id, rank)
        d.mkdir(parents=True, exist_ok=True)
        size = slot_size_for(nbytes)
        slots = self.tier.slot_states(job_id, rank)
        if not self.allocate:
            if len(slots) < self.min_slots:
                raise SlotAllocationNeeded(f"rank {rank} has {len(slots)} slots")
            slots = [s for s in slots if s.size >= nbytes]
        if len(slots) < self.min_slots:
            # First use: allocate the whole ring now (one-time cost, outside later saves).
            taken = {s.path.name for s in slots}
            k = 0
            while len(slots) < self.min_slots:
                name = layout.slot_name(k)
                k += 1
                if name in taken:
                    continue
                preallocate(d / name, size)
                slots.append(SlotState(d / name, size, []))
        candidates = [s for s in slots if s.path not in exclude]
        # 1. free slots (no step links them), or only stale partial links (a killed writer).
        for s in sorted(candidates, key=lambda s: (s.size < nbytes, s.path.name)):
            if all(not committed for _, committed in s.steps) and self._claim(
                job_id, rank, s, nbytes
            ):
                return s.path
        # 2. evict the oldest committed step beyond keep (never the newest).
        committed_steps = sorted({st for s in slots for st, c in s.steps if c})
        evictable = set(committed_steps[: max(0, len(committed_steps) - self.keep)])
        by_age = sorted(
            (s for s in candidates if s.steps and all(st in evictable for st, c in s.steps if c)),
            key=lambda s: max(st for st, _c in s.steps),
        )
        for s in by_age:
            if self._claim(job_id, rank, s, nbytes):
                return s.path
        # 3. grow the ring.
        if not self.allocate:
            raise SlotAllocationNeeded(f"no free slot of rank {rank} holds {nbytes} bytes")
        if len(slots) < self.max_slots:
            names = {s.path.name for s in slots}
            k = 0
            while layout.slot_name(k) in names:
                k += 1
            preallocate(d / layout.slot_name(k), size)
            log.info(
                "RAM slot ring of rank %d grew to %d slots (others busy)", rank, len(slots) + 1
            )
            return d / layout.slot_name(k)
        raise SlotsBusy(
            f"all {len(slots)} RAM slots of rank {rank} in {d} hold the newest {self.keep} "
            "committed step(s) or are being read (promotion); this save is skipped and the "
            "previous steps are intact. Raise ram.keep or save less often than promotion takes"
        )

    def _claim(self, job_id: str, rank: int, s: SlotState, nbytes: int) -> bool:
        fd = _try_lock(s.path, fcntl.LOCK_EX)
        if fd is None:
            return False
        try:
            for step, _committed in s.steps:
                self.tier.uncommit(job_id, step, rank)
            if s.size < nbytes:
                preallocate(s.path, slot_size_for(nbytes))
            return True
        finally:
            _unlock(fd)


class ReuseFirstSlotProvider:
    """Reuse a free local slot without a round trip; ask ``allocator`` (the sidecar) otherwise.

    The sidecar's local API costs ~1-2 ms a call (measured on the 2-core CI machine): more than
    the whole copy of a small state. Allocation and growth stay with the sidecar, so the tmpfs
    pages are still charged to its container.
    """

    def __init__(self, local: LocalSlotProvider, allocator: SlotProvider) -> None:
        if local.allocate:
            raise ValueError("ReuseFirstSlotProvider needs a reuse-only LocalSlotProvider")
        self.local = local
        self.allocator = allocator

    def acquire_slot(
        self, job_id: str, rank: int, nbytes: int, exclude: Collection[Path] = ()
    ) -> Path:
        try:
            return self.local.acquire_slot(job_id, rank, nbytes, exclude)
        except SlotAllocationNeeded:
            return self.allocator.acquire_slot(job_id, rank, nbytes, exclude)


class SlotLease:
    """Shared lock on a committed RAM shard while it is read (promotion, checksum, restore).

    ``with SlotLease(tier, job, step, rank) as lease:`` opens the shard's data (a slot), takes
    ``LOCK_SH`` (waiting up to ``timeout`` seconds while its writer holds ``LOCK_EX``), then
    re-checks that the step is still committed and still links that slot, and re-reads the
    manifest (``lease.manifest``; ``lease.path`` is the data path). While the lease is held the
    writer cannot reuse the slot. Raises :class:`ShardUnavailable` when the shard is not (or no
    longer) committed, or the lock is not granted in time. Works across processes (flock).
    """

    def __init__(
        self, tier: RamTier, job_id: str, step: int, rank: int, timeout: float = 10.0
    ) -> None:
        self.tier = tier
        self.job_id, self.step, self.rank = job_id, step, rank
        self.timeout = timeout
        self.path = tier.data_path(job_id, step, rank)
        self._fd: int | None = None
        self.manifest: Manifest | None = None

    def __enter__(self) -> SlotLease:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardUnavailable(f"{self.path}: not committed in the RAM tier") from None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ShardUnavailable(
                        f"{self.path}: its writer held it for {self.timeout:.0f} s"
                    ) from None
                time.sleep(0.002)
        try:
            same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            _unlock(fd)
            raise ShardUnavailable(f"{self.path}: un-committed while being leased")
        try:
            self.manifest = self.tier.get_manifest(self.job_id, self.step, self.rank)
        except BaseException:
            _unlock(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            self._fd = None


class SlotWriteLock:
    """``LOCK_EX`` on a slot obtained from a provider; retries other slots when one is leased."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(
        cls, provider: SlotProvider, job_id: str, rank: int, nbytes: int, attempts: int = 8
    ) -> SlotWriteLock:
        exclude: list[Path] = []
        for _ in range(attempts):
            path = provider.acquire_slot(job_id, rank, nbytes, exclude)
            fd = _try_lock(path, fcntl.LOCK_EX)
            if fd is not None:
                st = os.fstat(fd)
                # Still the slot (not deleted or replaced since the provider listed it), free
                # (no step links it) and large enough.
                if (
                    st.st_nlink == 1
                    and st.st_size >= nbytes
                    and path_identity(path) == identity_of(st)
                ):
                    return cls(path, fd)
                _unlock(fd)
            exclude.append(path)
        raise SlotsBusy(f"no lockable RAM slot for rank {rank} after {attempts} attempts")

    @property
    def fd(self) -> int:
        """The descriptor holding ``LOCK_EX`` (valid until :meth:`release`)."""
        if self._fd is None:
            raise TierError(f"RAM slot lock on {self.path} was already released")
        return self._fd

    @property
    def identity(self) -> Identity:
        """``(st_dev, st_ino)`` of the locked slot inode."""
        return identity_of(os.fstat(self.fd))

    def release(self) -> None:
        if self._fd is not None:
            _unlock(self._fd)
            self._fd = None

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.release()


class SlotMap(NamedTuple):
    """One persistent mapping: ``size`` bytes of the inode ``ident``, kept alive with the
    mapping lease held by ``fd`` (closed with the mapping)."""

    size: int
    mm: mmap.mmap
    ident: Identity
    fd: int


class SlotMaps:
    """Persistent writable mappings of slot files (``MAP_SHARED | MAP_POPULATE``), by path.

    Mapping a pre-allocated tmpfs file with MAP_POPULATE wires its pages into this process's
    page table once, so later copies into it take no page faults. Each mapping keeps its own
    file descriptor open with a mapping lease (:func:`take_mapping_lease`), so start-up pruning
    of a restarted sidecar never deletes a slot this process maps. A cached mapping is reused
    only while the path still names the same inode at the same size (a replaced or grown slot
    is remapped); a writer compares :meth:`identity` with its lock's inode before writing.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, SlotMap] = {}

    def get(self, path: Path) -> mmap.mmap:
        """A writable mapping of the file at ``path`` now."""
        ident = path_identity(path)
        cur = self._maps.get(path)
        if cur is not None and cur.ident == ident and cur.size == os.stat(path).st_size:
            return cur.mm
        if cur is not None:
            self._close(path)
        entry = self._map(path)
        self._maps[path] = entry
        return entry.mm

    def identity(self, path: Path) -> Identity | None:
        """The inode the cached mapping of ``path`` maps (None: not mapped)."""
        cur = self._maps.get(path)
        return cur.ident if cur is not None else None

    def mapping_of(self, ident: Identity | None) -> mmap.mmap | None:
        """The cached mapping of the inode ``ident`` (whatever path maps it), or None."""
        for entry in self._maps.values():
            if ident is not None and entry.ident == ident:
                return entry.mm
        return None

    def forget(self, path: Path) -> None:
        """Drop the mapping of ``path`` (if any)."""
        if path in self._maps:
            self._close(path)

    @staticmethod
    def _map(path: Path) -> SlotMap:
        """Open, lease and map ``path`` (its whole current size)."""
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            take_mapping_lease(fd)
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            raise
        return SlotMap(st.st_size, mm, identity_of(st), fd)

    @staticmethod
    def _release(entry: SlotMap) -> None:
        try:
            entry.mm.close()
        except BufferError:
            log.debug("a slot map is still exported; left to the garbage collector")
        os.close(entry.fd)

    def _close(self, path: Path) -> None:
        self._release(self._maps.pop(path))

    def close(self) -> None:
        for path in list(self._maps):
            self._close(path)
