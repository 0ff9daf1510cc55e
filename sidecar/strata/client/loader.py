"""Restore at memory bandwidth: one pass over a RAM shard that verifies and loads it.

:func:`load_shard` loads a committed RAM shard (a tmpfs file) into the live state in place.
The old path read every byte twice (a CRC32C pass when staging, then one ``Tensor.copy_`` per
tensor from a ``MAP_PRIVATE`` mapping, a page fault per 4 KiB on first touch). Here:

- the shard is never mapped for the fast path: ``preadv`` moves each block of the file straight
  into the live tensors (the kernel copies from the page cache: no page-table set-up, no fault
  per 4 KiB page; ``MAP_POPULATE`` of a 420 MB shard alone cost half a memcpy here);
- the codec walks the tree (:func:`strata.format.codec.load_into`) and hands every saved tensor
  whose live counterpart is a contiguous CPU tensor of the same dtype and shape to this module
  (a *fast* tensor) instead of copying it; everything else (views, other devices) the codec
  copies itself from a ``MAP_PRIVATE`` mapping, faulted only where it reads;
- the fast copies run across the copy threads, grouped by checksum chunk: each thread takes a
  run of chunks and, per block of :data:`BLOCK` bytes, reads the block into place (the bytes
  between fast tensors into a scratch buffer) and extends the chunk's CRC32C over what it just
  wrote while that is in cache (``preadv`` and the ctypes CRC call release the GIL). One read of
  the shard from memory, no second pass.

Ordering: the copies are deferred until the walk reaches a live ``state_dict()`` owner (its
``load_state_dict`` must see the loaded values: the pending copies are flushed first) or its end.

Verification contract: bytes are copied into the live tensors *before* the whole shard is known
good (that is the one pass). When a chunk's CRC32C differs from the manifest,
:class:`strata.errors.ShardCorrupt` is raised after the pass: the live state is then partly
overwritten and the caller must load another copy (``Checkpointer.restore`` quarantines this one
and re-plans; it refuses a fresh start over a partly overwritten state). A shard without
checksums yet (its writer stopped before the checksum pass) is checksummed in the same pass and
the CRCs are returned so the caller can record them.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strata.errors import ShardCorrupt
from strata.format import codec, crc
from strata.format.manifest import Manifest, StorageEntry, TensorEntry

BLOCK = 512 * 1024
"""Bytes read into place then checksummed together (still in L2/L3 for the checksum)."""
_IOV_MAX = 1024


@dataclass
class LoadOutcome:
    """What :func:`load_shard` did: the loaded tree, and the shard's CRCs as computed."""

    tree: Any
    chunk_crc32c: list[int]
    crc32c: int
    fast_bytes: int
    """Bytes copied by the one-pass path (the rest went through ``Tensor.copy_``)."""


def _crc_at(addr: int, n: int, value: int) -> int:
    lib = crc._LIB
    if lib is not None:
        return int(lib.crc32c_extend(value, addr, n))
    return crc.crc32c(ctypes.string_at(addr, n), value)  # pragma: no cover - no libcrc32c


class _OnePass:
    """Collects fast tensors during the codec walk and runs the chunked verify+copy pass."""

    def __init__(
        self,
        manifest: Manifest,
        fd: int,
        path: Path,
        pool: Executor | None,
        workers: int,
        device_source: Callable[[], torch.Tensor | None] | None = None,
    ) -> None:
        self.m = manifest
        self.device_source = device_source
        self._host: torch.Tensor | bool | None = None
        self.device_pending: list[tuple[int, torch.Tensor]] = []
        self.fd = fd
        self.path = path
        self.pool = pool
        self.workers = max(1, workers)
        self.chunk = manifest.chunk_size
        self.nchunks = crc.n_chunks(manifest.data_nbytes, self.chunk)
        self.crcs: list[int | None] = [None] * self.nchunks
        self.pending: list[tuple[int, int, int]] = []  # (src offset, dst address, nbytes)
        self.fast_bytes = 0

    # -- the codec's hooks ----------------------------------------------------------------------
    def sink(self, te: TensorEntry, se: StorageEntry, live: torch.Tensor) -> bool:
        """Take a saved tensor (entries checked by the codec, same dtype and shape as ``live``)
        when it can be copied as raw bytes: the saved view contiguous, ``live`` a contiguous CPU
        tensor, or a contiguous CUDA tensor when ``device_source`` gives a host view."""
        if not live.is_contiguous() or te.stride != _contiguous_stride(te.shape):
            return False
        itemsize = live.element_size()
        n = live.numel() * itemsize
        off = se.offset + te.storage_offset * itemsize
        if live.device.type == "cuda":
            if self._host is None and self.device_source is not None:
                self._host = self.device_source() or False
                self.device_source = None
            if self._host is False or self._host is None:
                return False
            if n:
                self.device_pending.append((off, live))
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
        by_chunk: dict[int, list[tuple[int, int, int]]] = {}
        for off, dst, n in self.pending:
            while n > 0:
                k = off // self.chunk
                take = min(n, (k + 1) * self.chunk - off)
                by_chunk.setdefault(k, []).append((off, dst, take))
                off, dst, n = off + take, dst + take, n - take
        self.pending = []
        self._run(sorted((k, sorted(p)) for k, p in by_chunk.items()))

    def _to_device(self) -> Callable[[], None]:
        """Enqueue the host-to-device copies (non-blocking, from the registered slot, on a side
        stream); returns the wait for them. The checksums of their chunks are the CPU's work
        meanwhile (``finish``)."""
        if not self.device_pending:
            return lambda: None
        host = self._host
        assert isinstance(host, torch.Tensor)
        device = self.device_pending[0][1].device
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for off, live in self.device_pending:
                n = live.numel() * live.element_size()
                live.view(-1).view(torch.uint8).copy_(host[off : off + n], non_blocking=True)
        self.device_pending = []
        return stream.synchronize

    def finish(self) -> tuple[list[int], int]:
        """Flush, then checksum the chunks no copy touched; (chunk CRCs, whole-object CRC)."""
        done = self._to_device()
        self._cpu_pass()
        self._run([(k, []) for k, c in enumerate(self.crcs) if c is None])
        done()
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
        size, total = self.chunk, self.m.data_nbytes
        scratch = ctypes.create_string_buffer(BLOCK)
        spare = ctypes.addressof(scratch)
        for k, pieces in work:
            start = k * size
            stop = min(start + size, total)
            if self.crcs[k] is not None:  # verified by an earlier flush: copy only
                for off, dst, n in pieces:
                    self._read(off, [(dst, n)])
                continue
            value = 0
            i = 0
            for b in range(start, stop, BLOCK):
                e = min(b + BLOCK, stop)
                # The block's bytes in order: fast pieces land in their live tensors, the
                # bytes between them (padding, tensors the codec copies) in a scratch buffer.
                targets: list[tuple[int, int]] = []
                at = b
                while i < len(pieces) and pieces[i][0] < e:
                    off, dst, n = pieces[i]
                    if off < at:  # bytes another live tensor takes too (a view): read apart
                        self._read(off, [(dst, n)])
                        i += 1
                        continue
                    if off > at:
                        targets.append((spare + (at - b), off - at))
                    take = min(n, e - off)
                    targets.append((dst, take))
                    at = off + take
                    if take < n:  # the piece goes on in the next block
                        pieces[i] = (e, dst + take, n - take)
                        break
                    i += 1
                if at < e:
                    targets.append((spare + (at - b), e - at))
                self._read(b, targets)
                for addr, n in targets:  # checksum what was just written, still in cache
                    value = _crc_at(addr, n, value)
            self.crcs[k] = value

    def _read(self, offset: int, targets: list[tuple[int, int]]) -> None:
        """``preadv`` the file from ``offset`` into ``targets`` ((address, bytes), in order)."""
        views = [
            memoryview((ctypes.c_char * n).from_address(addr)).cast("B") for addr, n in targets
        ]
        want = sum(n for _a, n in targets)
        done = 0
        while views:
            got = os.preadv(self.fd, views[:_IOV_MAX], offset + done)
            if got <= 0:
                raise ShardCorrupt(f"{self.path}: ends at byte {offset + done} (truncated)")
            done += got
            while views and got >= views[0].nbytes:
                got -= views[0].nbytes
                views.pop(0)
            if views and got:
                views[0] = views[0][got:]
        assert done == want


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
    device_source: Callable[[], torch.Tensor | None] | None = None,
    resolve: codec.Resolver | None = None,
) -> LoadOutcome:
    """Load the shard at ``path`` (its data file, ``manifest.data_nbytes`` bytes) into ``state``.

    ``pool``/``workers``: the threads sharing the pass (the calling thread works too).
    ``device_source()``: called once, at the first CUDA live tensor: a 1-D uint8 CPU tensor over
    the same bytes, page-locked (the RAM slot registered with CUDA), from which CUDA tensors are
    copied host-to-device while the CPU checksums; None, or no ``device_source``: CUDA tensors
    are copied by the codec (pageable).
    ``resolve``: loads sharded tensors (:data:`strata.format.codec.Resolver`).
    ``verify``: compare every chunk's CRC32C with the manifest (which must have them); when
    False the CRCs are still computed and returned. Raises :class:`ShardCorrupt` (a CRC32C
    mismatch, a truncated file: the live state is then partly overwritten, see the module
    docstring) and :class:`strata.format.codec.CodecError` (the checkpoint does not fit the live
    state).
    """
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
        private = mmap.mmap(
            f.fileno(), n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        try:
            one = _OnePass(manifest, f.fileno(), path, pool, workers, device_source)
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
            with contextlib.suppress(BufferError):  # a tensor still views it: the GC unmaps it
                private.close()
    if verify:
        bad = crc.first_bad_chunk(crcs, manifest.chunk_crc32c or [])
        if bad is not None or whole != manifest.crc32c:
            at = (
                f" in chunk {bad} (from byte {bad * manifest.chunk_size})"
                if bad is not None
                else ""
            )
            raise ShardCorrupt(
                f"{path}: CRC32C mismatch{at} against its manifest; the copy is corrupt, "
                "quarantine it and restore from another tier"
            )
    return LoadOutcome(tree, crcs, whole, one.fast_bytes)
