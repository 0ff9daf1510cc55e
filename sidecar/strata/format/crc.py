"""CRC32C (Castagnoli) helpers on google-crc32c: per-chunk and whole-object checksums.

A shard's data object is checksummed per ``chunk_size`` bytes (``Manifest.chunk_crc32c``, so a
partial read can be verified) and as a whole (``Manifest.crc32c``, the value GCS stores as the
object's ``crc32c``). The whole-object CRC is derived from the chunk CRCs with
:func:`crc32c_combine` instead of a second pass over the data, so chunks can be checksummed in
parallel threads (google-crc32c's C implementation releases the GIL for large buffers).

:func:`crc32c_combine` is zlib's ``crc32_combine`` (GF(2) matrix method, Mark Adler) with the
Castagnoli polynomial: ``crc(A + B) = combine(crc(A), crc(B), len(B))``.

google-crc32c's Python entry points accept only ``bytes`` and hold the GIL. For writable buffers
(slot mmaps, bytearrays) this module calls the same vendored ``libcrc32c`` through ctypes instead:
no copy, and ctypes releases the GIL, so threads do checksum in parallel. Without that library it
falls back to ``google_crc32c.value(bytes(chunk))``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import google_crc32c

from strata.errors import ShardCorrupt
from strata.format.manifest import DEFAULT_CHUNK_SIZE, SUB_CHUNK_SIZE, Manifest

_POLY = 0x82F63B78
"""CRC32C polynomial, reflected (bit-reversed 0x1EDC6F41)."""

Buffer = bytes | bytearray | memoryview | mmap.mmap

_T = TypeVar("_T")


def _load_libcrc32c() -> ctypes.CDLL | None:
    libs = os.path.join(
        os.path.dirname(os.path.dirname(google_crc32c.__file__)), "google_crc32c.libs"
    )
    for path in sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*"))):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    return None


_LIB = _load_libcrc32c()


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value`` (0 starts a new checksum)."""
    if isinstance(data, bytes):
        return int(google_crc32c.extend(value, data))
    view = memoryview(data).cast("B")
    try:
        return _crc_view(view, value)
    finally:
        view.release()


def _crc_view(view: memoryview, value: int = 0) -> int:
    n = view.nbytes
    if n == 0:
        return value
    if _LIB is not None and not view.readonly and view.contiguous:
        cbuf = (ctypes.c_char * n).from_buffer(view)
        try:
            return int(_LIB.crc32c_extend(value, ctypes.addressof(cbuf), n))
        finally:
            del cbuf
    return int(google_crc32c.extend(value, view.tobytes()))


def crc32c_address(addr: int, nbytes: int, value: int = 0) -> int:
    """CRC32C of the ``nbytes`` bytes at CPU address ``addr``, continuing from ``value``.

    The caller keeps that memory mapped and unchanged meanwhile (a mapped RAM slot, a CPU
    tensor's storage). The vendored ``libcrc32c`` runs without the GIL (threads checksum in
    parallel); without it the bytes are copied once for ``google_crc32c``.
    """
    if nbytes <= 0:
        return value
    if _LIB is not None:
        return int(_LIB.crc32c_extend(value, addr, nbytes))
    return int(google_crc32c.extend(value, ctypes.string_at(addr, nbytes)))


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: Sequence[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_operators() -> list[list[int]]:
    """``ops[k]`` appends ``2**k`` zero bytes to a CRC register (k = 0..63)."""
    one_bit = [_POLY] + [1 << n for n in range(31)]
    op = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 8 zero bits = one byte
    ops = [op]
    for _ in range(63):
        op = _gf2_square(op)
        ops.append(op)
    return ops


_ZERO_OPS = _zero_operators()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)``, ``len2 = len(B)`` bytes."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


@functools.lru_cache(maxsize=8)
def _shift_tables(nbytes: int) -> tuple[tuple[int, ...], ...]:
    """Four 256-entry tables applying "append ``nbytes`` zero bytes" to a CRC register, a byte
    of it each: a combine over a fixed length is then four lookups (:func:`join_pieces`)."""
    mat = [1 << n for n in range(32)]  # identity
    k = 0
    n = nbytes
    while n:
        if n & 1:
            mat = [_gf2_times(_ZERO_OPS[k], v) for v in mat]
        n >>= 1
        k += 1
    return tuple(tuple(_gf2_times(mat, b << (8 * j)) for b in range(256)) for j in range(4))


def join_pieces(piece_crcs: Sequence[int], nbytes: int, piece_size: int) -> int:
    """CRC32C of ``nbytes`` bytes from the CRCs of its consecutive ``piece_size`` pieces (the
    last one may be shorter): :func:`combine_chunks` at a few table lookups per piece (the save
    path derives every chunk's CRC from its sub-chunks' so)."""
    expected = n_chunks(nbytes, piece_size)
    if len(piece_crcs) != expected:
        raise ValueError(f"{len(piece_crcs)} piece CRCs for {nbytes} bytes, expected {expected}")
    if not piece_crcs:
        return 0
    t0, t1, t2, t3 = _shift_tables(piece_size)
    total = piece_crcs[0]
    last = len(piece_crcs) - 1
    for i in range(1, last):
        total = (
            t0[total & 255] ^ t1[(total >> 8) & 255] ^ t2[(total >> 16) & 255] ^ t3[total >> 24]
        ) ^ piece_crcs[i]
    if last:
        tail = nbytes - last * piece_size
        if tail == piece_size:
            total = (
                t0[total & 255] ^ t1[(total >> 8) & 255] ^ t2[(total >> 16) & 255] ^ t3[total >> 24]
            ) ^ piece_crcs[last]
        else:
            total = crc32c_combine(total, piece_crcs[last], tail)
    return total


def sub_chunk_size(chunk_size: int, sub_size: int = SUB_CHUNK_SIZE) -> int | None:
    """The sub-chunk size the save path records for ``chunk_size`` chunks: ``sub_size`` when it
    divides them into two or more pieces, else None (no sub-chunk CRCs)."""
    if 0 < sub_size < chunk_size and chunk_size % sub_size == 0:
        return sub_size
    return None


def piece_crcs_at(addr: int, nbytes: int, piece_size: int) -> list[int]:
    """CRC32C of every ``piece_size`` piece of the ``nbytes`` bytes at CPU address ``addr``
    (the caller keeps them mapped and unchanged; no GIL held during each piece)."""
    return [
        crc32c_address(addr + a, min(piece_size, nbytes - a)) for a in range(0, nbytes, piece_size)
    ]


def combine_chunks(chunk_crcs: Sequence[int], nbytes: int, chunk_size: int) -> int:
    """Whole-object CRC32C from the CRCs of consecutive ``chunk_size`` chunks of ``nbytes`` bytes."""
    expected = n_chunks(nbytes, chunk_size)
    if len(chunk_crcs) != expected:
        raise ValueError(f"{len(chunk_crcs)} chunk CRCs for {nbytes} bytes, expected {expected}")
    total = 0
    for i, c in enumerate(chunk_crcs):
        length = min(chunk_size, nbytes - i * chunk_size)
        total = crc32c_combine(total, c, length) if i else c
    return total


def n_chunks(nbytes: int, chunk_size: int) -> int:
    """Number of chunks of ``chunk_size`` covering ``nbytes`` (0 bytes -> 0 chunks)."""
    return (nbytes + chunk_size - 1) // chunk_size


def chunk_crcs(
    data: Buffer, nbytes: int | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, threads: int = 1
) -> tuple[list[int], int]:
    """(CRC32C of each ``chunk_size`` chunk of the first ``nbytes`` of ``data``, whole CRC32C).

    ``threads`` > 1 checksums chunks in parallel; the whole-object CRC is combined, not recomputed.
    """

    def one(view: memoryview, start: int, stop: int) -> int:
        with view[start:stop] as piece:
            return _crc_view(piece)

    crcs, n = _map_chunks(data, nbytes, chunk_size, threads, one)
    whole = combine_chunks(crcs, n, chunk_size) if crcs else 0
    return crcs, whole


def _map_chunks(
    data: Buffer,
    nbytes: int | None,
    chunk_size: int,
    threads: int,
    one: Callable[[memoryview, int, int], _T],
) -> tuple[list[_T], int]:
    """``one(view, start, stop)`` for each ``chunk_size`` chunk ``[start, stop)`` of the first
    ``nbytes`` (None: all) of ``data`` seen as bytes, in order, on ``threads`` threads when
    there is more than one chunk; returns (the results, ``nbytes``). The view is released
    before it returns. Raises ValueError when ``nbytes`` exceeds the buffer."""
    view = memoryview(data).cast("B")
    size = len(view)
    n = size if nbytes is None else nbytes
    if n > size:
        view.release()
        raise ValueError(f"asked to checksum {n} bytes of a {size}-byte buffer")
    starts = range(0, n, chunk_size)

    def chunk(start: int) -> _T:
        return one(view, start, min(start + chunk_size, n))

    try:
        if threads > 1 and len(starts) > 1:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="strata-crc") as pool:
                return list(pool.map(chunk, starts)), n
        return [chunk(s) for s in starts], n
    finally:
        view.release()


def chunk_and_sub_crcs(
    data: Buffer, nbytes: int, chunk_size: int, sub_size: int, threads: int = 1
) -> tuple[list[int], int, list[int]]:
    """:func:`chunk_crcs` that also returns the CRC32C of every ``sub_size`` piece (``sub_size``
    divides ``chunk_size``): one pass, each chunk's CRC joined from its pieces'
    (:func:`join_pieces`). Returns (chunk CRCs, whole CRC, piece CRCs)."""
    if chunk_size % sub_size:
        raise ValueError(f"sub-chunk size {sub_size} does not divide the chunk size {chunk_size}")

    def one(view: memoryview, start: int, stop: int) -> tuple[int, list[int]]:
        pieces = []
        for a in range(start, stop, sub_size):
            with view[a : min(a + sub_size, stop)] as piece:
                pieces.append(_crc_view(piece))
        return join_pieces(pieces, stop - start, sub_size), pieces

    results, _n = _map_chunks(data, nbytes, chunk_size, threads, one)
    crcs = [r[0] for r in results]
    subs = [c for r in results for c in r[1]]
    whole = combine_chunks(crcs, nbytes, chunk_size) if crcs else 0
    return crcs, whole, subs


def file_chunk_and_sub_crcs(
    path: str | os.PathLike[str], nbytes: int, chunk_size: int, sub_size: int, threads: int = 1
) -> tuple[list[int], int, list[int]]:
    """:func:`chunk_and_sub_crcs` of the first ``nbytes`` of the file at ``path``; raises as
    :func:`file_chunk_crcs` does."""
    if nbytes == 0:
        return [], 0, []
    with _mapped(path, nbytes) as mm:
        return chunk_and_sub_crcs(mm, nbytes, chunk_size, sub_size, threads)


def file_chunk_crcs(
    path: str | os.PathLike[str],
    nbytes: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    threads: int = 1,
) -> tuple[list[int], int]:
    """:func:`chunk_crcs` of the first ``nbytes`` of the file at ``path`` (read through mmap).

    Raises ``ValueError`` naming the file when it is shorter than ``nbytes`` (truncated shard).
    """
    if nbytes == 0:
        return [], 0
    with _mapped(path, nbytes) as mm:
        return chunk_crcs(mm, nbytes, chunk_size, threads)


@contextlib.contextmanager
def _mapped(path: str | os.PathLike[str], nbytes: int) -> Iterator[mmap.mmap]:
    """The first ``nbytes`` (> 0) of the file at ``path``, mapped; ``ValueError`` naming the
    file when it is shorter (a truncated shard)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < nbytes:
            raise ValueError(f"{Path(path)} holds {size} bytes, the manifest records {nbytes}")
        # A private writable mapping of a read-only file: nothing is ever written (so nothing is
        # copied), but ctypes can take its address and checksum it without the GIL.
        with mmap.mmap(
            f.fileno(), nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        ) as mm:
            yield mm


def first_bad_chunk(actual: Sequence[int], expected: Sequence[int]) -> int | None:
    """Index of the first chunk whose CRC differs (or where lengths differ), else None."""
    for i, (a, e) in enumerate(zip(actual, expected, strict=False)):
        if a != e:
            return i
    if len(actual) != len(expected):
        return min(len(actual), len(expected))
    return None


def check_shard_crcs(
    where: str | os.PathLike[str], manifest: Manifest, crcs: Sequence[int], whole: int
) -> None:
    """Compare a shard's computed CRC32Cs (per chunk and whole, as :func:`chunk_crcs` returns
    them) with the ones its ``manifest`` records.

    Raises :class:`strata.errors.ShardCorrupt` naming ``where`` and the first bad chunk (its
    index and first byte): the copy is corrupt; the caller quarantines it and restores from
    another tier.
    """
    bad = first_bad_chunk(crcs, manifest.chunk_crc32c or [])
    if bad is not None or whole != manifest.crc32c:
        at = f" in chunk {bad} (from byte {bad * manifest.chunk_size})" if bad is not None else ""
        raise ShardCorrupt(
            f"{where}: CRC32C mismatch{at} against its manifest; the copy is corrupt, "
            "quarantine it and restore from another tier"
        )
