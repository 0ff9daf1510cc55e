"""Incremental shards: a durable tier stores only the chunks that changed.

The RAM tier always holds a shard's whole data object (the save copies everything: the stall
does not grow, and a RAM restore needs nothing else). When a shard is promoted into a durable
tier (PVC, GCS), the chunks (``chunk_size`` pieces of the data object) whose bytes equal the same
chunk of an earlier *full* shard of the same rank in that tier (the *base*) are not written
again: the stored object holds the other chunks back to back, and the manifest's
:class:`~strata.format.manifest.ChunkRefs` says which chunks come from the base.

"Equal" is decided, never guessed (:func:`plan_refs`): the base has the same incarnation, world
size, chunk size, storage layout and length; the chunk's CRC32C equals the base's; and every
storage the chunk overlaps was reported unchanged by the trainer since the base step or earlier
(``Manifest.unchanged_since``: its address, size and tensor version counters did not change).
The version counter alone can miss writes (``tensor.data`` writes do not bump it) and the CRC32C
alone can collide; a chunk is referenced only when both agree.

References are one level deep: a base is always a full shard, so a restore reads at most two
objects (the step's and its base's), and retention keeps a base while a kept step names it.

No I/O here: :mod:`strata.tiers.references` reads and writes the objects.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.format import crc
from strata.format.manifest import ChunkRefs, Manifest

MIN_SHARED_FRACTION = 0.1
"""A shard is stored incrementally only when at least this fraction of its bytes is shared
(otherwise it is stored in full and becomes the next base)."""


def logical_nbytes(m: Manifest) -> int:
    """Length of the logical data object (what the codec addresses)."""
    return m.refs.logical_nbytes if m.refs is not None else m.data_nbytes


def logical_crc(m: Manifest) -> int | None:
    """Whole CRC32C of the logical data object (None: not checksummed yet)."""
    return m.refs.logical_crc32c if m.refs is not None else m.crc32c


def logical_chunk_crcs(m: Manifest) -> list[int] | None:
    return m.refs.logical_chunk_crc32c if m.refs is not None else m.chunk_crc32c


def logical_sub_crcs(m: Manifest) -> tuple[int, tuple[int, ...]] | None:
    """(piece size, CRC32C of every piece of the logical object) when ``m`` records usable
    sub-chunk CRCs (:class:`~strata.format.manifest.SubChunkCrcs`: a size that splits the chunks,
    one CRC per piece); None otherwise (a manifest without them, or with a malformed record:
    whole chunks are read and verified, as before)."""
    s = m.sub_crc32c
    if s is None or s.size >= m.chunk_size or m.chunk_size % s.size:
        return None
    try:
        values = s.values()
    except ValueError:
        return None
    if len(values) != crc.n_chunks(logical_nbytes(m), s.size):
        return None
    return s.size, values


def read_unit(m: Manifest) -> int:
    """Bytes per piece a ranged read of ``m``'s logical object verifies on its own: the
    sub-chunk size when recorded (:func:`logical_sub_crcs`), else ``m.chunk_size``."""
    subs = logical_sub_crcs(m)
    return subs[0] if subs is not None else m.chunk_size


def same_logical_shard(a: Manifest, b: Manifest) -> bool:
    """``a`` and ``b`` describe the same logical bytes (full or incremental copies alike)."""
    return logical_crc(a) == logical_crc(b) and logical_nbytes(a) == logical_nbytes(b)


def _chunk_storages(m: Manifest) -> list[list[int]]:
    """Per logical chunk, the storages overlapping it."""
    n = crc.n_chunks(m.data_nbytes, m.chunk_size)
    out: list[list[int]] = [[] for _ in range(n)]
    for i, s in enumerate(m.storages):
        if s.nbytes == 0:
            continue
        first = s.offset // m.chunk_size
        last = (s.offset + s.nbytes - 1) // m.chunk_size
        for k in range(first, min(last, n - 1) + 1):
            out[k].append(i)
    return out


def plan_refs(full: Manifest, base: Manifest) -> list[int]:
    """Chunks of ``full`` (a checksummed full shard) that may be read from ``base`` (a full
    shard committed in the destination tier) instead of being stored again; [] when ``base``
    cannot serve as a base (other incarnation, layout, size, or not full)."""
    if full.refs is not None or base.refs is not None or not full.verified or not base.verified:
        return []
    if base.step >= full.step or full.unchanged_since is None:
        return []
    if (
        base.incarnation != full.incarnation
        or base.world_size != full.world_size
        or base.rank != full.rank
        or base.chunk_size != full.chunk_size
        or base.data_nbytes != full.data_nbytes
        or base.storages != full.storages
        or len(full.unchanged_since) != len(full.storages)
    ):
        return []
    mine = full.chunk_crc32c or []
    theirs = base.chunk_crc32c or []
    out = []
    for k, storages in enumerate(_chunk_storages(full)):
        if k >= len(mine) or k >= len(theirs) or mine[k] != theirs[k]:
            continue
        if all(full.unchanged_since[i] <= base.step for i in storages):
            out.append(k)
    return out


def worth_it(full: Manifest, chunks: Sequence[int]) -> bool:
    """Whether referencing ``chunks`` saves enough to store ``full`` incrementally."""
    if not chunks or full.data_nbytes == 0:
        return False
    shared = sum(min(full.chunk_size, full.data_nbytes - k * full.chunk_size) for k in chunks)
    return shared >= MIN_SHARED_FRACTION * full.data_nbytes


def own_chunks(m: Manifest) -> list[int]:
    """Logical chunks stored in this copy's own data object, in stored order."""
    n = crc.n_chunks(logical_nbytes(m), m.chunk_size)
    if m.refs is None:
        return list(range(n))
    shared = set(m.refs.chunks)
    return [k for k in range(n) if k not in shared]


def chunk_len(nbytes: int, chunk_size: int, k: int) -> int:
    return min(chunk_size, nbytes - k * chunk_size)


def incremental_manifest(full: Manifest, base_step: int, chunks: Sequence[int]) -> Manifest:
    """The manifest of the incremental copy of ``full`` referencing ``chunks`` of ``base_step``."""
    crcs = full.chunk_crc32c or []
    assert full.crc32c is not None and len(crcs) == crc.n_chunks(full.data_nbytes, full.chunk_size)
    shared = set(chunks)
    own = [k for k in range(len(crcs)) if k not in shared]
    stored = sum(chunk_len(full.data_nbytes, full.chunk_size, k) for k in own)
    own_crcs = [crcs[k] for k in own]
    refs = ChunkRefs(
        base_step=base_step,
        chunks=sorted(shared),
        logical_nbytes=full.data_nbytes,
        logical_chunk_crc32c=list(crcs),
        logical_crc32c=full.crc32c,
    )
    return full.model_copy(
        update={
            "refs": refs,
            "data_nbytes": stored,
            "chunk_crc32c": own_crcs,
            "crc32c": crc.combine_chunks(own_crcs, stored, full.chunk_size) if own_crcs else 0,
        }
    )


def full_manifest(m: Manifest) -> Manifest:
    """The manifest of the logical (full) object of ``m`` (``m`` itself when it is full)."""
    if m.refs is None:
        return m
    return m.model_copy(
        update={
            "refs": None,
            "data_nbytes": m.refs.logical_nbytes,
            "chunk_crc32c": list(m.refs.logical_chunk_crc32c),
            "crc32c": m.refs.logical_crc32c,
        }
    )


def stored_ranges(m: Manifest) -> list[tuple[int, int, int]]:
    """(logical offset, stored offset, nbytes) of each chunk this copy stores itself."""
    n = logical_nbytes(m)
    out = []
    at = 0
    for k in own_chunks(m):
        length = chunk_len(n, m.chunk_size, k)
        out.append((k * m.chunk_size, at, length))
        at += length
    return out
