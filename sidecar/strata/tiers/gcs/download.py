"""Downloading a shard from GCS: byte ranges in parallel, every checksum chunk verified as it
arrives (see :meth:`GcsDownloader.fetch_shard`)."""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from google.api_core import exceptions as gexc

from strata.errors import ShardCorrupt, ShardUnavailable, TierError, TierFull
from strata.format import layout
from strata.format.crc import combine_chunks, crc32c
from strata.format.manifest import Manifest
from strata.tiers.gcs.client import (
    TRANSFER_ATTEMPTS,
    GcsBucket,
    transit_retry,
)
from strata.tiers.gcs.errors import (
    Aborted,
    TransferCorrupt,
    TransitMismatch,
)

log = logging.getLogger(__name__)


class GcsDownloader(GcsBucket):
    """The read path of the GCS tier."""

    def read_range(self, job_id: str, step: int, rank: int, offset: int, nbytes: int) -> bytes:
        """:meth:`strata.tiers.base.Tier.read_range` as one ranged GET (``Range: bytes=``):
        only the bytes asked for cross the network; the caller verifies them against the
        manifest's chunk CRC32Cs (a range has no server-side checksum)."""
        if nbytes <= 0:
            return b""
        key = layout.data_key(job_id, step, rank)
        name = self.object_name(key)
        with self._errors("downloading", name, missing=ShardUnavailable):
            try:
                return bytes(
                    self._bucket.blob(name).download_as_bytes(
                        start=offset,
                        end=offset + nbytes - 1,
                        checksum=None,  # per range; checked against the manifest's chunks
                        retry=self._retry,
                        timeout=self.request_timeout,
                    )
                )
            except gexc.RequestRangeNotSatisfiable:
                return b""  # the object ends before offset: the caller calls it truncated

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        """Download the data object into ``dst_path``, verifying every chunk as it arrives.

        ``dst_path`` is created if missing and NOT truncated (it may be a pre-faulted RAM slot
        longer than the shard, as with the POSIX tiers); bytes beyond ``data_nbytes`` are left as
        they were. The stored object's size and CRC32C are compared with the manifest first (no
        transfer of a copy known to be bad); then byte ranges of at least ``chunk_size_bytes``,
        aligned to the manifest's checksum chunks, are downloaded by ``max_workers`` threads,
        all pinned to one object generation. With ``verify`` each manifest chunk's CRC32C is
        checked as its last byte arrives (a mismatch aborts the download) and the whole-object
        CRC32C at the end. Raises :class:`ShardUnavailable` (not committed here),
        :class:`ShardCorrupt` (missing data, wrong size or a CRC32C mismatch: the caller
        quarantines and falls back), or another :class:`GcsError`.
        """
        manifest = self.get_manifest(job_id, step, rank)
        if verify and not manifest.verified:
            raise ShardUnavailable(
                f"{self.manifest_url(job_id, step, rank)} records no CRC32C (not written by "
                "Strata's commit protocol); it cannot be verified"
            )
        key = layout.data_key(job_id, step, rank)
        name = self.object_name(key)
        where = self.url(key)
        stored = self.committed_data(job_id, step, rank, "downloading")
        if verify:
            self._check_blob(stored, manifest, "stored object")
        elif stored.size != manifest.data_nbytes:
            raise ShardCorrupt(
                f"{where} holds {stored.size} bytes, its manifest records "
                f"{manifest.data_nbytes}; quarantine it and restore from another tier"
            )
        nbytes = manifest.data_nbytes
        cs = manifest.chunk_size
        span = max(cs, math.ceil(self.config.chunk_size_bytes / cs) * cs)
        ranges = [(off, min(off + span, nbytes)) for off in range(0, nbytes, span)]
        pinned = self._bucket.blob(name, generation=stored.generation)
        abort = threading.Event()
        dst = Path(dst_path)
        try:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            raise TierError(f"cannot open {dst} for writing ({exc.strerror})") from exc
        try:
            sinks = [
                _ChunkVerifyingSink(fd, start, end, manifest if verify else None, where, abort)
                for start, end in ranges
            ]

            def one(sink: _ChunkVerifyingSink) -> None:
                def attempt() -> None:
                    sink.reset()
                    with self._errors("downloading", name, missing=ShardCorrupt):
                        pinned.download_to_file(
                            sink,
                            start=sink.start,
                            end=sink.end - 1,
                            checksum=None,  # per range; checked against the manifest instead
                            retry=self._retry,
                            timeout=self.request_timeout,
                        )
                    sink.finish()

                # The stored object's CRC32C matched the manifest, so a range that does not
                # (TransitMismatch) was damaged on the way: fetch it again, never quarantine.
                retrying = transit_retry(
                    TransitMismatch, lambda exc: log.warning("%s; downloading the range again", exc)
                )
                try:
                    retrying(attempt)
                except TransitMismatch as exc:
                    raise TransferCorrupt(
                        f"{exc} in {TRANSFER_ATTEMPTS} downloads, although the stored "
                        "object's CRC32C matches its manifest: the bytes are damaged in "
                        "transit (check the network path or proxy); the stored copy is "
                        "kept, restore from another tier meanwhile"
                    ) from None

            if len(sinks) == 1:
                one(sinks[0])
            elif sinks:
                with ThreadPoolExecutor(
                    max_workers=min(self.config.max_workers, len(sinks)),
                    thread_name_prefix="strata-gcs-down",
                ) as pool:
                    futures = [pool.submit(one, sink) for sink in sinks]
                    for future in as_completed(futures):
                        if future.exception() is not None:
                            abort.set()
                errors = [e for f in futures if (e := f.exception()) is not None]
                # Report the range that failed first, not the ranges it stopped.
                errors.sort(key=lambda e: isinstance(e, Aborted))
                if errors:
                    raise errors[0]
        except OSError as exc:
            abort.set()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"no space left writing {dst} from {where}") from exc
            raise TierError(f"writing {dst} from {where} failed ({exc})") from exc
        finally:
            os.close(fd)
        if verify and nbytes:
            crcs = [c for sink in sinks for c in sink.crcs]
            whole = combine_chunks(crcs, nbytes, cs)
            if whole != manifest.crc32c:
                raise ShardCorrupt(
                    f"{where}: whole-object CRC32C {whole} != {manifest.crc32c} in its manifest; "
                    "quarantine it and restore from another tier"
                )
        return manifest


class _ChunkVerifyingSink:
    """The file object one ranged download writes into.

    Writes land at their offset in the destination (``os.pwrite``, so ranges can arrive in any
    order from several threads without a shared file position) and, with a manifest, every
    manifest chunk's CRC32C is computed on the fly and compared the moment the chunk is complete.
    ``start`` is a multiple of the manifest's ``chunk_size``; ``end`` is exclusive.
    """

    def __init__(
        self,
        fd: int,
        start: int,
        end: int,
        manifest: Manifest | None,
        where: str,
        abort: threading.Event,
    ) -> None:
        self.fd = fd
        self.start = start
        self.end = end
        self.pos = start
        self.manifest = manifest
        self.where = where
        self.abort = abort
        self.crcs: list[int] = []
        self._crc = 0

    def write(self, data: bytes) -> int:
        if self.abort.is_set():
            raise Aborted(self.where)
        view = memoryview(data)
        if self.pos + len(view) > self.end:
            raise TransitMismatch(f"{self.where}: more bytes arrived than requested")
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], self.pos + written)
        if self.manifest is not None:
            self._checksum(view)
        else:
            self.pos += len(view)
        return len(view)

    def _checksum(self, view: memoryview) -> None:
        assert self.manifest is not None
        cs = self.manifest.chunk_size
        while view:
            room = cs - (self.pos % cs)
            piece, view = view[:room], view[room:]
            self._crc = crc32c(piece, self._crc)
            self.pos += len(piece)
            if self.pos % cs == 0 or self.pos == self.manifest.data_nbytes:
                self._chunk_done()

    def _chunk_done(self) -> None:
        assert self.manifest is not None
        index = (self.pos - 1) // self.manifest.chunk_size
        expected = self.manifest.chunk_crc32c or []
        if index >= len(expected) or self._crc != expected[index]:
            raise TransitMismatch(
                f"{self.where}: CRC32C mismatch in chunk {index} (bytes from "
                f"{index * self.manifest.chunk_size}) against its manifest"
            )
        self.crcs.append(self._crc)
        self._crc = 0

    def reset(self) -> None:
        """Start the range over (a new download attempt)."""
        self.pos = self.start
        self.crcs = []
        self._crc = 0

    def finish(self) -> None:
        """Raise when the range ended early."""
        if self.pos != self.end:
            raise TransitMismatch(
                f"{self.where}: download of bytes {self.start}-{self.end} ended at {self.pos}"
            )
