"""Reading and writing incremental shards (:mod:`strata.format.incremental`) through the
:class:`~strata.tiers.base.Tier` contract, so every tier (PVC, GCS, ...) gets them alike.

- :func:`write_incremental`: the stored object of an incremental copy (the chunks it does not
  reference, back to back), from a local file of the full data object.
- :func:`fetch_full`: a committed incremental copy reassembled into a local file (a RAM slot):
  its own chunks from its stored object, the referenced ones from its base in the same tier,
  every chunk checked against the logical CRC32C before the file is handed out.
- :func:`read_logical`: a byte range of a committed copy's logical object, aligned to the
  pieces its manifest can verify (sub-chunks of :data:`~strata.format.manifest.SUB_CHUNK_SIZE`
  where recorded, else chunks), read by ranged reads (:meth:`Tier.read_range`: ``pread``, GCS
  ranged GETs) of the stored object and of its base, every piece checked against the logical
  CRC32Cs (resharding reads only what it needs).
- :func:`verify_following_refs`: verification of a committed copy and of what it references.
- :func:`referenced_bases`: the base steps that kept steps reference (retention keeps them).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from strata.errors import ShardCorrupt, ShardUnavailable, TierError
from strata.format import crc
from strata.format.incremental import (
    chunk_len,
    full_manifest,
    logical_chunk_crcs,
    logical_nbytes,
    logical_sub_crcs,
    own_chunks,
    read_unit,
    stored_ranges,
)
from strata.format.manifest import Manifest
from strata.tiers.base import Tier


def _pread_exact(fd: int, n: int, offset: int, where: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ShardCorrupt(f"{where}: short read at byte {offset} (truncated); quarantine it")
    return data


def write_incremental(src: Path, stored: Manifest, dst: Path) -> int:
    """Write the stored object of the incremental manifest ``stored`` into ``dst`` from
    ``src`` (the full data object); returns its length in bytes. Each chunk is checked against
    its CRC32C on the way (:class:`ShardCorrupt`: the source changed or is corrupt)."""
    expected = stored.chunk_crc32c or []
    written = 0
    sfd = os.open(src, os.O_RDONLY)
    try:
        with open(dst, "wb") as out:
            for j, (logical_off, _stored_off, n) in enumerate(stored_ranges(stored)):
                piece = _pread_exact(sfd, n, logical_off, str(src))
                if crc.crc32c(piece) != expected[j]:
                    raise ShardCorrupt(
                        f"{src}: CRC32C mismatch at byte {logical_off} against its manifest"
                    )
                out.write(piece)
                written += n
            out.flush()
    finally:
        os.close(sfd)
    return written


def write_projected(
    src: Path, full: Manifest, projected: Manifest, pieces: list[tuple[int, int, int]], dst: Path
) -> Manifest:
    """Write the archive-only data object of ``projected`` (:func:`strata.format.projection.
    project` of ``full``) into ``dst`` from ``src`` (the full data object) and return
    ``projected`` with its checksums. ``src`` is first checked against ``full``'s CRC32Cs
    (:class:`ShardCorrupt`), so no corrupt byte is sealed into the archive."""
    got, whole = crc.file_chunk_crcs(src, full.data_nbytes, full.chunk_size)
    if got != (full.chunk_crc32c or []) or whole != full.crc32c:
        raise ShardCorrupt(f"{src}: CRC32C mismatch against its manifest; quarantine it")
    sfd = os.open(src, os.O_RDONLY)
    try:
        with open(dst, "wb") as out:
            for src_off, dst_off, n in pieces:
                out.seek(dst_off)
                out.write(_pread_exact(sfd, n, src_off, str(src)))
            out.truncate(projected.data_nbytes)
    finally:
        os.close(sfd)
    crcs, whole = crc.file_chunk_crcs(dst, projected.data_nbytes, projected.chunk_size)
    return projected.model_copy(update={"chunk_crc32c": crcs, "crc32c": whole})


def _local_data(tier: Tier, job_id: str, step: int, rank: int, tmp: Path) -> Path:
    """A local file of the committed data object (where it lies, or fetched and verified)."""
    path = tier.data_path(job_id, step, rank)
    if path is not None:
        return path
    out = tmp / f"step-{step}"
    tier.fetch_shard(job_id, step, rank, out, verify=True)
    return out


BASE_RUN_BYTES = 64 * 1024 * 1024
"""Most bytes of one ranged read of a base's referenced chunks (:func:`fetch_full`)."""
BASE_READERS = 4
"""Ranged reads of a base in flight at once (:func:`fetch_full` from a remote tier)."""


def _pull_referenced(
    tier: Tier,
    job_id: str,
    base_step: int,
    rank: int,
    stored: Manifest,
    dst: Path,
    bad_base: Callable[[str], ShardCorrupt],
) -> None:
    """Write the logical chunks ``stored`` references into ``dst`` at their logical offsets,
    read from ``base_step``'s data object of ``tier`` by ranged reads, each chunk checked
    against the logical CRC32C (``bad_base(reason)``: the error to raise)."""
    refs = stored.refs
    assert refs is not None
    cs, total = stored.chunk_size, refs.logical_nbytes
    expected = refs.logical_chunk_crc32c
    runs: list[list[int]] = []  # [first chunk, chunk after the last]
    for k in refs.chunks:
        if runs and runs[-1][1] == k and (k + 1 - runs[-1][0]) * cs <= BASE_RUN_BYTES:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])

    def pull(run: list[int], fd: int) -> str | None:
        """None, or why the base's copy is bad (raised once, by the calling thread)."""
        lo, hi = run[0] * cs, min(run[1] * cs, total)
        data = tier.read_range(job_id, base_step, rank, lo, hi - lo)
        if len(data) != hi - lo:
            return f"its copy ends at byte {lo + len(data)}, before chunk {run[0]} ends"
        view = memoryview(data)
        for k in range(run[0], run[1]):
            a = k * cs - lo
            if crc.crc32c(view[a : a + chunk_len(total, cs, k)]) != expected[k]:
                return f"chunk {k} referenced does not match its CRC32C"
        os.pwrite(fd, data, lo)
        return None

    fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if len(runs) <= 1:
            why = [pull(run, fd) for run in runs]
        else:
            with ThreadPoolExecutor(BASE_READERS, thread_name_prefix="strata-base") as pool:
                why = list(pool.map(lambda run: pull(run, fd), runs))
    except OSError as exc:
        raise TierError(f"writing the base's chunks into {dst} failed: {exc}") from exc
    finally:
        os.close(fd)
    bad = next((w for w in why if w is not None), None)
    if bad is not None:
        raise bad_base(bad)


def fetch_full(
    tier: Tier,
    job_id: str,
    step: int,
    rank: int,
    stored: Manifest,
    dst: Path,
    *,
    quarantine: bool = True,
) -> Manifest:
    """Reassemble the committed incremental copy ``stored`` of ``tier`` into ``dst`` (created
    if missing, never truncated: it may be a RAM slot) and return the full manifest.

    Every chunk is checked against the logical CRC32C on its way into ``dst``. A tier with local
    files (PVC) is read in place, chunk by chunk; from a remote tier (GCS) only the chunks the
    step references are read from the base, by ranged reads (:meth:`Tier.read_range`: runs of
    consecutive chunks of at most :data:`BASE_RUN_BYTES`, :data:`BASE_READERS` at a time)
    straight into ``dst`` (no temporary copy of the base, and none of the base's chunks that
    the step replaced), and the step's own chunks (a small temporary file) beside them.
    Raises :class:`ShardUnavailable` when the base
    is not committed in ``tier`` (the step cannot be served from here); :class:`ShardCorrupt`
    when a chunk does not match: the base's copy is quarantined first when the bad chunk came
    from it (the caller quarantines the step and falls back to another tier);
    ``quarantine=False`` (a read-only check) leaves the base as is.
    """
    refs = stored.refs
    if refs is None:
        raise ValueError("fetch_full needs an incremental manifest")
    full = full_manifest(stored)
    base_m = tier.get_manifest(job_id, refs.base_step, rank)
    if base_m.refs is not None or base_m.data_nbytes != refs.logical_nbytes:
        raise ShardCorrupt(
            f"{tier.name}: step {step} rank {rank} references step {refs.base_step}, which is "
            "not a full shard of the same length; restore from another tier"
        )
    expected = refs.logical_chunk_crc32c
    own_at = {k: j * stored.chunk_size for j, k in enumerate(own_chunks(stored))}

    def bad_base(reason: str) -> ShardCorrupt:
        if quarantine:
            tier.quarantine(job_id, refs.base_step, rank, reason)
        return ShardCorrupt(
            f"{tier.name}: base step {refs.base_step} of step {step} rank {rank}: {reason}; "
            "restore from another tier"
        )

    def bad_own(k: int) -> ShardCorrupt:
        return ShardCorrupt(
            f"{tier.name}: step {step} rank {rank}: chunk {k} does not match its CRC32C; "
            "quarantine it and restore from another tier"
        )

    base_path = tier.data_path(job_id, refs.base_step, rank)
    with tempfile.TemporaryDirectory(prefix="strata-refs-") as tmpdir:
        tmp = Path(tmpdir)
        if base_path is None:
            # Remote: the referenced chunks are the base's own chunks (a chunk is referenced only
            # when its CRC32C equals the base's), verified against the base's manifest while
            # they arrive; say which one differs before anything is downloaded.
            base_crcs = base_m.chunk_crc32c or []
            for k in range(crc.n_chunks(refs.logical_nbytes, stored.chunk_size)):
                if k not in own_at and (k >= len(base_crcs) or base_crcs[k] != expected[k]):
                    raise bad_base(f"chunk {k} referenced by step {step} is not the base's")
            _pull_referenced(tier, job_id, refs.base_step, rank, stored, dst, bad_base)
        crcs = list(expected) if base_path is None else []
        own_path = _local_data(tier, job_id, step, rank, tmp)
        ofd = os.open(own_path, os.O_RDONLY)
        bfd = os.open(base_path, os.O_RDONLY) if base_path is not None else -1
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for k in range(crc.n_chunks(refs.logical_nbytes, stored.chunk_size)):
                if base_path is None and k not in own_at:
                    continue  # downloaded and verified above
                n = chunk_len(refs.logical_nbytes, stored.chunk_size, k)
                if k in own_at:
                    piece = _pread_exact(ofd, n, own_at[k], str(own_path))
                else:
                    piece = _pread_exact(bfd, n, k * stored.chunk_size, str(base_path))
                c = crc.crc32c(piece)
                if c != expected[k]:
                    if k not in own_at:
                        raise bad_base(
                            f"chunk {k} referenced by step {step} does not match its CRC32C"
                        )
                    raise bad_own(k)
                if base_path is not None:
                    crcs.append(c)
                os.pwrite(dfd, piece, k * stored.chunk_size)
        except OSError as exc:
            raise TierError(
                f"reassembling step {step} rank {rank} into {dst} failed: {exc}"
            ) from exc
        finally:
            os.close(ofd)
            if bfd >= 0:
                os.close(bfd)
            os.close(dfd)
    if (
        crcs
        and crc.combine_chunks(crcs, refs.logical_nbytes, stored.chunk_size) != refs.logical_crc32c
    ):
        raise ShardCorrupt(f"{tier.name}: step {step} rank {rank}: whole CRC32C mismatch")
    return full


def read_logical(
    tier: Tier, job_id: str, step: int, rank: int, m: Manifest, start: int, stop: int
) -> bytearray:
    """Bytes ``[start, stop)`` of the logical data object of the committed copy ``m`` of
    ``tier`` (an incremental copy: its own chunks from its stored object, the referenced ones
    from its base step's), every byte verified.

    ``start`` must be a multiple of :func:`~strata.format.incremental.read_unit` (the sub-chunk
    size when ``m`` records sub-chunk CRCs, else ``m.chunk_size``) and ``stop`` one too or the
    logical end (callers round outwards: :func:`chunk_span`). A chunk read whole is checked
    against its (logical) chunk CRC32C; a part of a chunk against its sub-chunk CRCs, once those
    are shown to combine to the chunk's CRC32C (so they are as trusted as the chunk list).
    Consecutive pieces stored back to back in one object are read with one
    :meth:`Tier.read_range`. Raises ``ValueError`` (a range not so aligned),
    :class:`ShardCorrupt` (bytes that do not match, an object shorter than its manifest, or
    sub-chunk CRCs that do not combine to their chunk's: nothing is quarantined here, the caller
    decides), :class:`ShardUnavailable` (an object is gone) or another :class:`TierError`.
    """
    cs = m.chunk_size
    total = logical_nbytes(m)
    expected = logical_chunk_crcs(m)
    if expected is None:
        raise ShardUnavailable(f"{tier.name}: step {step} rank {rank} has no checksums yet")
    subs = logical_sub_crcs(m)
    unit = subs[0] if subs is not None else cs
    if start % unit or not (stop % unit == 0 or stop == total) or not 0 <= start <= stop <= total:
        raise ValueError(
            f"range {start}-{stop} is not aligned to pieces of {unit} bytes in {total}"
        )
    out = bytearray(stop - start)
    if stop == start:
        return out
    refs = m.refs
    own_at = {k: j * cs for j, k in enumerate(own_chunks(m))}
    first, last = start // cs, (stop - 1) // cs
    # Runs: (object's step, offset in that object, offset in out, length).
    runs: list[list[int]] = []
    for k in range(first, last + 1):
        lo, hi = max(start, k * cs), min(stop, k * cs + chunk_len(total, cs, k))
        if refs is None or k in own_at:
            where = (step, own_at[k] + lo - k * cs)
        else:
            where = (refs.base_step, lo)
        run = runs[-1] if runs else None
        if run is not None and run[0] == where[0] and run[1] + run[3] == where[1]:
            run[3] += hi - lo
        else:
            runs.append([where[0], where[1], lo - start, hi - lo])
    view = memoryview(out)
    for src_step, offset, at, length in runs:
        data = tier.read_range(job_id, src_step, rank, offset, length)
        if len(data) != length:
            raise ShardCorrupt(
                f"{tier.name}: step {src_step} rank {rank} ends at byte {offset + len(data)}, "
                f"its manifest records more (truncated); restore from another tier"
            )
        view[at : at + length] = data
    try:
        for k in range(first, last + 1):
            c0, n = k * cs, chunk_len(total, cs, k)
            lo, hi = max(start, c0), min(stop, c0 + n)
            src = "its base step " + str(refs.base_step) if refs and k not in own_at else "it"
            if lo == c0 and hi == c0 + n:
                good = crc.crc32c(view[c0 - start : c0 - start + n]) == expected[k]
            else:
                assert subs is not None  # a part of a chunk is aligned only to sub-chunks
                g, values = subs
                if crc.join_pieces(values[c0 // g : (c0 + n - 1) // g + 1], n, g) != expected[k]:
                    raise ShardCorrupt(
                        f"{tier.name}: step {step} rank {rank}: the sub-chunk CRC32Cs of chunk "
                        f"{k} in its manifest do not combine to the chunk's CRC32C; restore "
                        "from another tier"
                    )
                good = all(
                    crc.crc32c(view[a - start : min(a + g, hi) - start]) == values[a // g]
                    for a in range(lo, hi, g)
                )
            if not good:
                raise ShardCorrupt(
                    f"{tier.name}: step {step} rank {rank}: chunk {k} (read from {src}) fails "
                    "its CRC32C checksum; quarantine it and restore from another tier"
                )
    finally:
        view.release()
    return out


def chunk_span(m: Manifest, offset: int, nbytes: int) -> tuple[int, int]:
    """The ``[start, stop)`` of ``m``'s logical object covering ``nbytes`` bytes at ``offset``
    (``nbytes`` > 0), rounded out to the pieces :func:`read_logical` verifies on their own
    (:func:`~strata.format.incremental.read_unit`: sub-chunks, or whole chunks for a manifest
    without sub-chunk CRCs)."""
    unit = read_unit(m)
    return (offset // unit) * unit, min(
        ((offset + nbytes - 1) // unit + 1) * unit, logical_nbytes(m)
    )


def verify_following_refs(tier: Tier, job_id: str, step: int, rank: int) -> Manifest:
    """:meth:`Tier.verify_shard`, and for an incremental copy also every chunk it takes from its
    base (read-only: nothing is quarantined). Returns the stored manifest; raises as
    :func:`fetch_full` does."""
    m = tier.verify_shard(job_id, step, rank)
    if m.refs is not None:
        fetch_full(tier, job_id, step, rank, m, Path(os.devnull), quarantine=False)
    return m


def referenced_bases(
    tier: Tier, job_id: str, steps: Iterable[int], ranks: Iterable[int]
) -> set[int]:
    """Base steps referenced by the committed shards of ``ranks`` in ``steps`` of ``tier``
    (shards that cannot be read are skipped: they reference nothing we can honour)."""
    out: set[int] = set()
    ranks = list(ranks)
    for step in steps:
        for rank in ranks:
            try:
                m = tier.get_manifest(job_id, step, rank)
            except (ShardUnavailable, TierError):
                continue
            if m.refs is not None:
                out.add(m.refs.base_step)
    return out
