"""Restore at memory bandwidth: one pass over a RAM shard that verifies and loads it.

:func:`load_shard` loads a committed RAM shard (a tmpfs file) into the live state in place.
The old path read every byte twice (a CRC32C pass when staging, then one ``Tensor.copy_`` per
tensor from a ``MAP_PRIVATE`` mapping, a page fault per 4 KiB on first touch). Here:

- the shard's bytes are read through a *shared* mapping: the saver's own mapping of the slot
  when this process already maps it (populated once, no fault at all: the usual RAM hit after
  a save), else a fresh read-only ``MAP_SHARED`` mapping, whose read faults map 16 pages of
  the page cache at a time (fault-around; a ``MAP_PRIVATE`` or ``MAP_POPULATE`` mapping, or
  ``preadv`` into place, cost 1.3-2x a memcpy here, this about 1.1-1.4x);
- the codec walks the tree (:func:`strata.format.codec.load_into`) and hands every saved tensor
  whose live counterpart is a contiguous CPU tensor of the same dtype and shape to this module
  (a *fast* tensor) instead of copying it; everything else (views, other devices) the codec
  copies itself from a ``MAP_PRIVATE`` mapping, faulted only where it reads;
- the fast copies run across the copy threads, grouped by checksum chunk: each thread takes a
  run of chunks and, per block of :data:`BLOCK` bytes (sized for L2), ``memmove``-s the
  block's fast pieces into the live tensors and extends the chunk's CRC32C over what was just
  written, still in cache (the bytes no fast tensor takes: over the mapping). Both are C calls
  that release the GIL. One read of the shard from memory, no second pass. (Checksumming the
  mapping first and copying after measured 1.35x slower than this order here.)

Ordering: the copies are deferred until the walk reaches a live ``state_dict()`` owner (its
``load_state_dict`` must see the loaded values: the pending copies are flushed first) or its end.

Verification contract: bytes are copied into the live tensors *before* the whole shard is known
good (that is the one pass). When a chunk's CRC32C differs from the manifest,
:class:`strata.errors.ShardCorrupt` is raised after the pass: the live state is then partly
overwritten and the caller must load another copy (``Checkpointer.restore`` quarantines this one
and re-plans; it refuses a fresh start over a partly overwritten state). A shard without
checksums yet (its writer stopped before the checksum pass) is checksummed in the same pass and
the CRCs are returned so the caller can record them. A shard already verified by its stager
(copied from the PVC or GCS with its CRC32Cs checked on the way) is loaded with
``checksum=False``: a plain parallel copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strata.client import device as devices
from strata.client.device import Stream
from strata.errors import RestoreError, ShardCorrupt
from strata.format import codec, crc
from strata.format.manifest import Manifest, StorageEntry, TensorEntry

BLOCK = 512 * 1024
"""Bytes checksummed then copied out together (still in L2/L3 for the copy). Measured on the
2-core EPYC with a 426 MB shard: 512 KiB-4 MiB within noise of each other, 128 KiB 1.3x slower."""

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_LIBC.munmap.restype = ctypes.c_int
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_move = ctypes.memmove


@dataclass
class LoadOutcome:
    """What :func:`load_shard` did: the loaded tree, and the shard's CRCs as computed."""

    tree: Any
    chunk_crc32c: list[int]
    """Per-chunk CRC32C as computed by the pass; empty with ``checksum=False``."""
    crc32c: int
    """Whole-object CRC32C (0 with ``checksum=False`` or an empty shard)."""
    fast_bytes: int
    """Bytes copied by the one-pass path (the rest went through ``Tensor.copy_``)."""
    cuda: bool = False
    """Whether some live tensor offered by the codec is a CUDA tensor."""


def _crc_at(addr: int, n: int, value: int) -> int:
    lib = crc._LIB
    if lib is not None:
        return int(lib.crc32c_extend(value, addr, n))
    return crc.crc32c(ctypes.string_at(addr, n), value)  # pragma: no cover - no libcrc32c


@contextlib.contextmanager
def _shared_view(fd: int, nbytes: int, mapped: mmap.mmap | None) -> Iterator[int]:
    """The address of the shard's first byte in a shared mapping of it, for the ``with`` block.

    ``mapped``: the caller's mapping of the same file (at least ``nbytes``; e.g. the saver's
    populated slot mapping), used as is. Else ``fd`` is mapped read-only ``MAP_SHARED`` (nothing
    can be written into the shard through it) and unmapped on exit (on a thread of its own).
    Raises ``OSError``.
    """
    if mapped is not None:
        if len(mapped) < nbytes:
            raise ValueError(f"a mapping of {len(mapped)} bytes for a {nbytes}-byte shard")
        anchor = ctypes.c_char.from_buffer(mapped)
        try:
            yield ctypes.addressof(anchor)
        finally:
            del anchor
        return
    addr = _LIBC.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of the shard failed: {os.strerror(err)}")
    try:
        yield int(addr)
    finally:
        # Tearing down the page tables of a faulted-in 426 MB mapping took ~29 ms here (a third
        # of the copy): done on a thread of its own, off the restore's path (nothing uses the
        # address after this block).
        threading.Thread(
            target=_LIBC.munmap, args=(addr, nbytes), name="strata-unmap", daemon=True
        ).start()


class _OnePass:
    """Collects fast tensors during the codec walk and runs the chunked verify+copy pass."""

    def __init__(
        self,
        manifest: Manifest,
        base: int,
        pool: Executor | None,
        workers: int,
        device_source: Callable[[], torch.Tensor | None] | None = None,
        checksum: bool = True,
    ) -> None:
        self.m = manifest
        self.device_source = device_source
        self._host: torch.Tensor | bool | None = None
        self.device_pending: list[tuple[int, torch.Tensor, int]] = []
        """(offset in the shard, live device tensor, its device index) to copy host-to-device."""
        self.dev = devices.active()
        self._streams: dict[int, Stream] = {}
        self.base = base
        self.pool = pool
        self.workers = max(1, workers)
        self.checksum = checksum
        self.chunk = manifest.chunk_size
        self.nchunks = crc.n_chunks(manifest.data_nbytes, self.chunk)
        self.crcs: list[int | None] = [None] * self.nchunks
        self.pending: list[tuple[int, int, int]] = []  # (src offset, dst address, nbytes)
        self.fast_bytes = 0
        self.cuda = False

    def host_view(self, index: int) -> torch.Tensor | None:
        """The registered host view of the shard (``device_source()``, asked once, with device
        ``index`` current while the slot is registered); None when there is none."""
        if self._host is None and self.device_source is not None:
            # Never ``device_source() or False``: that calls bool() on a multi-element tensor
            # (RuntimeError: ambiguous), failing every restore that registration made fast.
            with self.dev.using(index):
                host = self.device_source()
            self._host = host if host is not None else False
            self.device_source = None
        return self._host if isinstance(self._host, torch.Tensor) else None

    # -- the codec's hooks ----------------------------------------------------------------------
    def sink(self, te: TensorEntry, se: StorageEntry, live: torch.Tensor) -> bool:
        """Take a saved tensor (entries checked by the codec, same dtype and shape as ``live``)
        when it can be copied as raw bytes: the saved view contiguous, ``live`` a contiguous CPU
        tensor, or a contiguous CUDA tensor when ``device_source`` gives a host view."""
        index = self.dev.index_of(live)
        if index is not None:
            self.cuda = True
        if not live.is_contiguous() or te.stride != _contiguous_stride(te.shape):
            return False
        itemsize = live.element_size()
        n = live.numel() * itemsize
        off = se.offset + te.storage_offset * itemsize
        if index is not None:
            if self.host_view(index) is None:
                return False
            if n:
                self.device_pending.append((off, live, index))
                self.fast_bytes += n
            return True
        if live.device.type != "cpu":
            return False
        if n:
            self.pending.append((off, live.data_ptr(), n))
            self.fast_bytes += n
        return True

    def flush(self) -> None:
        """Run the pass over the chunks the pending copies touch (and copy them)."""
        done = self._to_device()
        self._cpu_pass()
        done()

    def _cpu_pass(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        apart = _aliased(pending)
        by_chunk: dict[int, list[tuple[int, int, int]]] = {}
        for j, (off, dst, n) in enumerate(pending):
            if j in apart:
                continue  # copied below; its saved bytes are checksummed from the mapping
            while n > 0:
                k = off // self.chunk
                take = min(n, (k + 1) * self.chunk - off)
                by_chunk.setdefault(k, []).append((off, dst, take))
                off, dst, n = off + take, dst + take, n - take
        self._run(sorted(by_chunk.items()))
        for j in sorted(apart):  # in the walk's order: the last one wins, as with Tensor.copy_
            off, dst, n = pending[j]
            _move(dst, self.base + off, n)

    def _to_device(self) -> Callable[[], None]:
        """Enqueue the host-to-device copies (non-blocking, from the registered slot, on a side
        stream); returns the wait for them. The checksums of their chunks are the CPU's work
        meanwhile (``finish``)."""
        if not self.device_pending:
            return lambda: None
        host = self._host
        assert isinstance(host, torch.Tensor)
        dev = self.dev
        by_device: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for off, live, index in self.device_pending:
            by_device.setdefault(index, []).append((off, live))
        events = []
        # One side stream and event per device: a copy enqueued on another device's stream
        # would run on its own device's current stream, unordered with the event waited for.
        for index, pieces in sorted(by_device.items()):
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = dev.stream(index)
            stream.wait_stream(dev.current_stream(index))
            for off, live in pieces:
                n = live.numel() * live.element_size()
                dev.copy(live, host[off : off + n], stream)
            event = dev.event(index)
            event.record(stream)
            events.append(event)
        self.device_pending = []

        def wait() -> None:
            for event in events:
                event.synchronize()

        return wait

    def finish(self) -> tuple[list[int], int]:
        """Flush, then checksum the chunks no copy touched; (chunk CRCs, whole-object CRC);
        ``([], 0)`` without ``checksum``."""
        done = self._to_device()
        self._cpu_pass()
        if self.checksum:
            self._run([(k, []) for k, c in enumerate(self.crcs) if c is None])
        done()
        if not self.checksum:
            return [], 0
        crcs = [int(c) for c in self.crcs if c is not None]
        whole = crc.combine_chunks(crcs, self.m.data_nbytes, self.chunk) if crcs else 0
        return crcs, whole

    # -- the pass -------------------------------------------------------------------------------
    def _run(self, work: list[tuple[int, list[tuple[int, int, int]]]]) -> None:
        if not work:
            return
        if self.pool is None or self.workers == 1 or len(work) == 1:
            self._chunks(work)
            return
        share = -(-len(work) // self.workers)
        groups = [work[i : i + share] for i in range(0, len(work), share)]
        futures = [self.pool.submit(self._chunks, g) for g in groups[1:]]
        self._chunks(groups[0])  # the calling thread works too
        for fut in futures:
            fut.result()

    def _chunks(self, work: list[tuple[int, list[tuple[int, int, int]]]]) -> None:
        base, size, total = self.base, self.chunk, self.m.data_nbytes
        for k, pieces in work:
            if self.crcs[k] is not None or not self.checksum:  # verified already: copy only
                for off, dst, n in pieces:
                    _move(dst, base + off, n)
                continue
            start = k * size
            stop = min(start + size, total)
            # Each piece cut at the block edges: a block's pieces are copied, then checksummed
            # while in cache (views of one storage may overlap: each is copied, CRC'd once).
            blocks: list[list[tuple[int, int, int]]] = [
                [] for _ in range(-(-(stop - start) // BLOCK))
            ]
            for off, dst, n in pieces:
                while n > 0:
                    j = (off - start) // BLOCK
                    take = min(n, start + (j + 1) * BLOCK - off)
                    blocks[j].append((off, dst, take))
                    off, dst, n = off + take, dst + take, n - take
            value = 0
            for j, cut in enumerate(blocks):
                at = start + j * BLOCK  # bytes before ``at`` are in the CRC
                for off, dst, n in sorted(cut):
                    _move(dst, base + off, n)
                    if off > at:  # bytes no fast tensor takes: from the mapping
                        value = _crc_at(base + at, off - at, value)
                        at = off
                    if off + n > at:  # what was just written, still in cache
                        value = _crc_at(dst + (at - off), off + n - at, value)
                        at = off + n
                end = min(start + (j + 1) * BLOCK, stop)
                if end > at:
                    value = _crc_at(base + at, end - at, value)
            self.crcs[k] = value


def _registered_chunks(
    resolve: codec.Resolver, one: _OnePass, private: mmap.mmap
) -> codec.Resolver:
    """``resolve`` handed, for a sharded tensor whose live local tensor is on a device, the same
    bytes in the registered RAM slot (``one``'s host view) instead of the private mapping: its
    host-to-device copy then runs from page-locked memory at the link's speed, as the loader's
    own copies do. Sharded chunks are copied after the shard is read, not verified in the pass:
    as before, verification of the whole shard follows at the end of the load."""
    anchor = ctypes.c_char.from_buffer(private)
    base = ctypes.addressof(anchor)
    del anchor
    size = len(private)

    def twin(entry: Any, live: Any, chunk: torch.Tensor | None, path: str) -> Any:
        local = getattr(live, "_local_tensor", live)
        index = one.dev.index_of(local) if isinstance(local, torch.Tensor) else None
        if chunk is not None and index is not None and chunk.is_contiguous():
            host = one.host_view(index)
            off = chunk.data_ptr() - base
            n = chunk.numel() * chunk.element_size()
            if host is not None and off >= 0 and off + n <= min(size, host.numel()):
                chunk = host[off : off + n].view(chunk.dtype).view(chunk.shape)
        return resolve(entry, live, chunk, path)

    return twin


def _aliased(pieces: list[tuple[int, int, int]]) -> set[int]:
    """Indices of the ``(saved offset, live address, bytes)`` copies whose live bytes another
    copy of OTHER saved bytes writes too (live tensors sharing memory that were saved apart,
    e.g. tied weights restored from an untied checkpoint). Such copies must not take part in
    the parallel pass: one thread checksums what it just wrote while another thread overwrites
    it, so a good shard failed verification (was quarantined) almost every time. Copies of the
    same saved bytes into the same live bytes (views of one storage on both sides) are fine."""
    order = sorted(range(len(pieces)), key=lambda j: pieces[j][1])
    reach = 0
    overlap = False
    for j in order:
        _off, dst, n = pieces[j]
        if n and dst < reach:
            overlap = True
            break
        reach = max(reach, dst + n)
    if not overlap:
        return set()
    out: set[int] = set()
    live: list[int] = []  # copies still covering the sweep position
    for j in order:
        off, dst, n = pieces[j]
        if not n:
            continue
        live = [i for i in live if pieces[i][1] + pieces[i][2] > dst]
        for i in live:
            if pieces[i][1] - pieces[i][0] != dst - off:
                out.update((i, j))
        live.append(j)
    return out


def _contiguous_stride(shape: list[int]) -> list[int]:
    out = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= max(shape[d], 1)
    return out


def load_shard(
    state: Any,
    manifest: Manifest,
    path: Path,
    *,
    pool: Executor | None,
    workers: int,
    verify: bool,
    checksum: bool = True,
    mapped: mmap.mmap | None = None,
    device_source: Callable[[], torch.Tensor | None] | None = None,
    resolve: codec.Resolver | None = None,
) -> LoadOutcome:
    """Load the shard at ``path`` (its data file, ``manifest.data_nbytes`` bytes) into ``state``.

    ``pool``/``workers``: the threads sharing the pass (the calling thread works too).
    ``mapped``: a shared mapping of the same file (at least ``data_nbytes`` bytes: the saver's
    populated slot mapping) to read from; None: a read-only mapping made (and unmapped) here.
    ``device_source()``: called once, at the first CUDA live tensor: a 1-D uint8 CPU tensor over
    the same bytes, page-locked (the RAM slot registered with CUDA), from which CUDA tensors are
    copied host-to-device while the CPU checksums; None, or no ``device_source``: CUDA tensors
    are copied by the codec (pageable).
    ``resolve``: loads sharded tensors (:data:`strata.format.codec.Resolver`).
    ``verify``: compare every chunk's CRC32C with the manifest (which must have them); when
    False the CRCs are still computed and returned, unless ``checksum`` is False too (a shard
    its stager verified: nothing is checksummed, the outcome's CRCs are empty). Raises
    :class:`ShardCorrupt` (a CRC32C mismatch, a truncated file: the live state is then partly
    overwritten, see the module docstring), :class:`strata.format.codec.CodecError` (the
    checkpoint does not fit the live state; nothing written) and ``OSError`` (the file cannot be
    opened or mapped; nothing written).
    """
    checksum = checksum or verify
    n = manifest.data_nbytes
    if n == 0:
        tree = codec.load_into(state, manifest, bytearray(), where=str(path), resolve=resolve)
        return LoadOutcome(tree, [], 0, 0)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < n:
            raise ShardCorrupt(f"{path} holds {size} bytes, the manifest records {n} (truncated)")
        # The codec's own copies (views, other devices) need a torch tensor over the bytes, and
        # torch refuses read-only buffers: a private writable mapping, faulted only where read.
        with _shared_view(f.fileno(), n, mapped) as base:
            private = mmap.mmap(
                f.fileno(), n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            try:
                one = _OnePass(manifest, base, pool, workers, device_source, checksum)
                if resolve is not None and device_source is not None:
                    resolve = _registered_chunks(resolve, one, private)
                tree = codec.load_into(
                    state,
                    manifest,
                    private,
                    where=str(path),
                    sink=one.sink,
                    flush=one.flush,
                    resolve=resolve,
                )
                crcs, whole = one.finish()
            finally:
                # Closed before the shared view is unmapped: that unmap (on a thread of its own)
                # holds the process's mmap lock for ~25 ms, which this munmap waited for.
                with contextlib.suppress(BufferError):  # a tensor still views it: the GC unmaps
                    private.close()
    if verify:
        crc.check_shard_crcs(path, manifest, crcs, whole)
    return LoadOutcome(tree, crcs, whole, one.fast_bytes, one.cuda)


LoadFailure = tuple[bool, str] | None
"""One rank's outcome of loading its shard, as exchanged with the other ranks: None (loaded),
``(False, why)`` (a corrupt copy: quarantined, every rank re-plans) or ``(True, why)`` (any
other failure: every rank's restore raises)."""


def load_failure(exc: BaseException | None) -> LoadFailure:
    """This rank's :data:`LoadFailure` for the exception its load raised (None: it loaded)."""
    if exc is None:
        return None
    return (not isinstance(exc, ShardCorrupt), f"{type(exc).__name__}: {exc}")


def settle_load(
    outcomes: list[LoadFailure], rank: int, step: int, own: BaseException | None
) -> bool:
    """Decide a load of ``step`` from every rank's :data:`LoadFailure` (``outcomes``, by rank,
    gathered by every rank: so every rank decides the same; a rank that raised without taking
    part in that gather would leave the others waiting in it for ever). ``own``: this rank's
    exception. Returns True when every rank loaded, False when some copy was corrupt (re-plan).
    Raises ``own`` when it is a failure other than a corrupt copy (a state that does not fit
    the checkpoint keeps its :class:`strata.errors.CodecError`), else :class:`RestoreError`
    naming the ranks whose load failed so."""
    if own is not None and not isinstance(own, ShardCorrupt):
        raise own
    fatal = [f"rank {r}: {o[1]}" for r, o in enumerate(outcomes) if o is not None and o[0]]
    if fatal:
        raise RestoreError(
            f"step {step} could not be loaded on every rank ({'; '.join(fatal)}); rank {rank} "
            "stops its restore too (its state may be partly loaded): fix the failing rank and "
            "call restore() again"
        )
    return all(o is None for o in outcomes)
