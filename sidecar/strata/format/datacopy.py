"""Copying an encoded state's storages into its data object: :func:`write_data` (no I/O).

The data object is the storages of :class:`strata.format.codec.EncodedState` back to back, each
at its ``StorageEntry.offset`` (aligned to :data:`strata.format.manifest.ALIGN`), with the
alignment padding zeroed so the bytes (and the CRC32C) depend only on the state.

CPU states are copied with libc ``memmove``/``memset`` (ctypes; they release the GIL and start
no threads) over about equal byte ranges, one per copy thread. The list of pieces depends only
on the layout, so an encode that reused its layout (:class:`strata.format.encode_cache.Layout`)
reuses the list built by the first save of that layout: a save of 10,000 small tensors then
costs one ``memmove`` call per tensor and nothing else (bench W3). Other states (a CUDA
storage, a CUDA destination) go through ``Tensor.copy_`` in pieces of at most 8 MiB.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from strata.format.encode_cache import Layout
    from strata.format.manifest import StorageEntry

Buffer = bytearray | memoryview | mmap.mmap
_COPY_PIECE = 8 * 1024 * 1024
"""Bytes per ``Tensor.copy_`` task: big storages are split so several threads share one copy."""
_MIN_TASK_BYTES = 1024 * 1024
"""Below this, a copy is not worth a thread hand-off."""

Piece = tuple[int, int, int, int]
"""``(destination offset, storage index or -1 for a zero fill, offset in the storage, bytes)``."""


class EncodedState(Protocol):
    """What the copy needs of an encoded state (:class:`strata.format.codec.EncodedState`):
    its storages' entries and byte sources, the data object's size, and its reusable layout
    (None: none), where copy plans are cached."""

    @property
    def sources(self) -> list[torch.Tensor]: ...

    @property
    def storages(self) -> list[StorageEntry]: ...

    @property
    def data_nbytes(self) -> int: ...

    @property
    def layout(self) -> Layout | None: ...


def as_uint8(buf: Buffer | torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over ``buf`` (no copy). ValueError for a tensor of another shape."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError("a data buffer tensor must be 1-D uint8")
        return buf
    if len(memoryview(buf)) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _workers(pool: Executor | None) -> int:
    return max(1, getattr(pool, "_max_workers", 4)) if pool is not None else 1


def write_data(
    enc: EncodedState,
    dst: Buffer | torch.Tensor,
    pool: Executor | None = None,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Copy every storage of ``enc`` into ``dst`` (writable, >= ``enc.data_nbytes`` bytes).

    Alignment padding is zeroed. ``pool``: the copy threads (the calling thread copies a share
    too). ``skip``: indices of storages whose bytes ``dst`` already holds at their offsets (not
    copied; :mod:`strata.client.reuse`). Returns when every byte is copied. Raises ValueError
    when ``dst`` is too small.
    """
    out = as_uint8(dst)
    if out.numel() < enc.data_nbytes:
        raise ValueError(
            f"destination holds {out.numel()} bytes, the state needs {enc.data_nbytes}"
        )
    layout = enc.layout
    cpu = (not layout.cuda) if layout is not None else _all_cpu(enc)
    if out.device.type == "cpu" and cpu:
        _write_cpu(enc, out.data_ptr(), pool, skip)
        return
    pieces: list[tuple[int, int, torch.Tensor]] = []  # (offset, nbytes, source)
    end = 0
    for i, (entry, src) in enumerate(zip(enc.storages, enc.sources, strict=True)):
        if entry.offset > end:
            out[end : entry.offset].zero_()
        for start in range(0, 0 if i in skip else entry.nbytes, _COPY_PIECE):
            stop = min(start + _COPY_PIECE, entry.nbytes)
            pieces.append((entry.offset + start, stop - start, src[start:stop]))
        end = entry.offset + entry.nbytes
    if pool is None or len(pieces) <= 1:
        _copy_pieces(out, pieces)
        return
    # One task per ~equal share of the bytes, not one per tensor: a task costs ~10 us of
    # scheduling, more than copying a small tensor (many-small-tensor states, W3 of bench/).
    share = max(_MIN_TASK_BYTES, -(-end // _workers(pool)))
    groups: list[list[tuple[int, int, torch.Tensor]]] = [[]]
    acc = 0
    for piece in pieces:
        if acc >= share:
            groups.append([])
            acc = 0
        groups[-1].append(piece)
        acc += piece[1]
    if len(groups) == 1:
        _copy_pieces(out, groups[0])
        return
    futures = [pool.submit(_copy_pieces, out, group) for group in groups[1:]]
    _copy_pieces(out, groups[0])  # the calling thread works too
    for fut in futures:
        fut.result()


def _all_cpu(enc: EncodedState) -> bool:
    return all(src.device.type == "cpu" for src in enc.sources)


def cpu_plan(
    enc: EncodedState, workers: int, skip: frozenset[int] = frozenset()
) -> list[list[Piece]]:
    """The pieces of a CPU copy of ``enc`` (storages in ``skip`` left out, padding zeroed)
    split into at most ``workers`` groups of about equal bytes (a storage is split between
    groups when needed, so one big tensor still uses every thread); cached on ``enc.layout``
    when there is one and nothing is skipped. Each group is a list of :data:`Piece`."""
    layout = enc.layout if not skip else None
    if layout is not None:
        plan = layout.plans.get(workers)
        if plan is not None:
            return plan
    pieces: list[Piece] = []
    end = total = 0
    for sidx, entry in enumerate(enc.storages):
        if entry.offset > end:
            pieces.append((end, -1, 0, entry.offset - end))
            total += entry.offset - end
        if entry.nbytes and sidx not in skip:
            pieces.append((entry.offset, sidx, 0, entry.nbytes))
            total += entry.nbytes
        end = entry.offset + entry.nbytes
    share = max(_MIN_TASK_BYTES, -(-total // workers))
    groups: list[list[Piece]] = [[]]
    room = share
    for dst, sidx, src, n in pieces:
        while n > 0:
            take = min(n, room)
            groups[-1].append((dst, sidx, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room == 0:
                groups.append([])
                room = share
    plan = [g for g in groups if g]
    if layout is not None:
        layout.plans[workers] = plan
    return plan


def _memcpy_pieces(base: int, ptrs: Sequence[int], pieces: Sequence[Piece]) -> None:
    move, fill = ctypes.memmove, ctypes.memset
    for dst, sidx, src, n in pieces:
        if sidx >= 0:
            move(base + dst, ptrs[sidx] + src, n)
        else:
            fill(base + dst, 0, n)


def _write_cpu(
    enc: EncodedState, base: int, pool: Executor | None, skip: frozenset[int] = frozenset()
) -> None:
    """CPU path of :func:`write_data`: libc memcpy over ~equal byte ranges, one per worker.

    Why: every ``Tensor.copy_`` (and the two slices it needs) costs 20-40 us of dispatch, which
    for 10,000 small tensors is ~30x the memcpy itself (bench W3), and inside the pool's threads
    torch's own intra-op threads oversubscribe the cores. ``enc.sources`` keep the storages
    alive meanwhile.
    """
    layout = enc.layout
    ptrs = layout.ptrs if layout is not None else [s.data_ptr() for s in enc.sources]
    groups = cpu_plan(enc, _workers(pool), skip)
    if pool is None or len(groups) <= 1:
        for group in groups:
            _memcpy_pieces(base, ptrs, group)
        return
    futures = [pool.submit(_memcpy_pieces, base, ptrs, group) for group in groups[1:]]
    _memcpy_pieces(base, ptrs, groups[0])  # the calling thread works too
    for fut in futures:
        fut.result()


def _copy_pieces(out: torch.Tensor, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
    for offset, nbytes, src in pieces:
        out[offset : offset + nbytes].copy_(src)
