"""One streamed upload of a byte range of a local file: a resumable upload session (opened by
the client, with the object's metadata and ``ifGenerationMatch=0``) finished by ONE ``PUT`` whose
body is read from the file in 1 MiB blocks, each block CRC32C-checked as it is read (GCS
promotion at the copy floor).

Why not ``Blob.upload_from_file``: the client reads a resumable upload ``chunk_size`` bytes at a
time into memory and sends each in its own request. With chunks small enough for the sidecar's
memory budget (8 MiB) a shard took many requests, and each costs a round trip (and
fake-gcs-server re-handles the whole object per request: measured, a 71 MB shard in 8 MiB chunks
took 2.4x ``upload_from_filename``'s one 100 MiB request). Here the body streams from the file:
one request per object, 1 MiB of memory per upload, whatever the object's size.

Integrity: the bytes sent are the bytes checksummed. Each manifest chunk inside the range is
compared with the manifest as it streams: a mismatch aborts the request before the object is
finalized, so a corrupt source never becomes an object (:class:`SourceCorrupt`). The CRC32C of
the whole range is compared with the one GCS computed of what it stored: a mismatch is damage in
transit (:class:`TransitMismatch` for the caller, which deletes the object).

Retries (``tenacity``): a failed attempt (connection error, timeout, 408/429/5xx) is retried from
the start in a new session after 1, 2, 4 ... 32 s, as long as the next attempt would start within
``deadline`` seconds; a session that never finished leaves no object. Other statuses raise the matching
``google.api_core.exceptions`` error (412: the object exists; the caller decides).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

import requests
import tenacity
from google.api_core import exceptions as gexc
from google.cloud import storage

from strata.format import crc
from strata.tiers.gcs.client import crc32c_of_b64
from strata.tiers.gcs.errors import SourceCorrupt, TransitMismatch

log = logging.getLogger(__name__)

BLOCK_BYTES = 1024 * 1024
"""Bytes read, checksummed and handed to the socket at a time (the memory one upload holds)."""

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class CheckedBody:
    """Request body: bytes ``[offset, offset + length)`` of ``fd``, read in blocks of
    :data:`BLOCK_BYTES` into one reused buffer, each manifest chunk (``chunk_size`` bytes from
    offset 0 of the file, CRC32Cs ``chunk_crcs``) that lies wholly in the range checked as it
    ends. Iterating again starts over (a retried request re-reads the file).

    ``crc32c``: CRC32C of the bytes sent by the last complete iteration. Raises
    :class:`SourceCorrupt` naming ``src_name`` from the iteration (a chunk mismatch, or the file
    ends early).
    """

    def __init__(
        self,
        fd: int,
        offset: int,
        length: int,
        chunk_size: int,
        chunk_crcs: Sequence[int],
        src_name: str,
    ) -> None:
        self.fd, self.offset, self.length = fd, offset, length
        self.chunk_size, self.chunk_crcs, self.src_name = chunk_size, chunk_crcs, src_name
        self.crc32c = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[memoryview]:
        end = self.offset + self.length
        buf = bytearray(min(BLOCK_BYTES, max(self.length, 1)))
        view = memoryview(buf)
        whole = 0
        chunk_crc = 0
        pos = self.offset
        while pos < end:
            chunk = pos // self.chunk_size
            chunk_start = chunk * self.chunk_size
            chunk_end = chunk_start + self.chunk_size
            k = min(len(buf), end - pos, chunk_end - pos)
            piece = view[:k]
            got = _read_full(self.fd, piece, pos)
            if got < k:
                raise SourceCorrupt(
                    f"source {self.src_name} ends at byte {pos + got}, its manifest records more "
                    "(truncated); nothing was committed. Quarantine the source and promote from "
                    "another tier"
                )
            whole = crc.crc32c(piece, whole)
            chunk_crc = crc.crc32c(piece, 0 if pos == chunk_start else chunk_crc)
            pos += k
            last = chunk == len(self.chunk_crcs) - 1
            whole_chunk = chunk_start >= self.offset and (pos == chunk_end or (pos == end and last))
            if whole_chunk and (
                chunk >= len(self.chunk_crcs) or chunk_crc != self.chunk_crcs[chunk]
            ):
                raise SourceCorrupt(
                    f"source {self.src_name} does not match its manifest: CRC32C mismatch "
                    f"in chunk {chunk} (from byte {chunk_start}); nothing was committed. "
                    "Quarantine the source and promote from another tier"
                )
            yield piece
        self.crc32c = whole


def upload_range(
    client: storage.Client,
    blob: storage.Blob,
    body: CheckedBody,
    *,
    request_timeout: float,
    deadline: float,
) -> storage.Blob:
    """Upload ``body`` as the object ``blob`` (its name, metadata and content type) create-only
    (``ifGenerationMatch=0``), in one streamed request per attempt; returns ``blob`` with the
    stored object's properties (generation, size, crc32c).

    ``deadline``: seconds to keep retrying transient failures. Raises :class:`SourceCorrupt`
    (the source does not match; no object), :class:`TransitMismatch` (the stored object's CRC32C
    differs from the bytes sent: the object exists, delete it), a
    ``google.api_core.exceptions.GoogleAPICallError`` (``PreconditionFailed``: the name exists;
    ``NotFound``: no bucket; ``Forbidden`` ...) or ``requests`` errors once retries run out.
    """
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_transient),
        wait=tenacity.wait_exponential(multiplier=1.0, max=32.0),
        stop=tenacity.stop_before_delay(deadline),
        before_sleep=_log_retry,
        reraise=True,
    )
    uploaded: storage.Blob = retrying(_attempt, client, blob, body, request_timeout)
    return uploaded


def _transient(exc: BaseException) -> bool:
    """Whether a failed attempt may succeed in a new session (connection, timeout, 408/429/5xx)."""
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in _RETRY_STATUS
    return isinstance(exc, requests.ConnectionError | requests.Timeout)


def _log_retry(state: tenacity.RetryCallState) -> None:
    blob = state.args[1]
    why = state.outcome.exception() if state.outcome is not None else None
    log.info("upload of gs://%s/%s failed (%s); retrying", blob.bucket.name, blob.name, why)


def _attempt(
    client: storage.Client, blob: storage.Blob, body: CheckedBody, request_timeout: float
) -> storage.Blob:
    url = blob.create_resumable_upload_session(
        content_type=blob.content_type or "application/octet-stream",
        size=body.length,
        client=client,
        timeout=request_timeout,
        checksum=None,
        if_generation_match=0,
    )
    n = body.length
    headers = {"Content-Range": f"bytes 0-{n - 1}/{n}" if n else f"bytes */{n}"}
    resp = client._http.put(url, data=body, headers=headers, timeout=request_timeout)
    if resp.status_code not in (200, 201):
        raise gexc.from_http_response(resp)  # type: ignore[no-untyped-call]
    blob._set_properties(resp.json())
    stored = crc32c_of_b64(blob.crc32c)
    if stored != body.crc32c or blob.size != n:
        raise TransitMismatch(
            f"gs://{blob.bucket.name}/{blob.name}: GCS stored {blob.size} bytes with crc32c "
            f"{stored}, the {n} bytes sent have CRC32C {body.crc32c}"
        )
    return blob


def range_crc32c(fd: int, offset: int, length: int) -> int:
    """CRC32C of bytes ``[offset, offset + length)`` of ``fd``, read in :data:`BLOCK_BYTES`
    blocks (bounded memory). Raises ``EOFError`` when the file ends early."""
    buf = bytearray(min(BLOCK_BYTES, max(length, 1)))
    view = memoryview(buf)
    value = 0
    pos, end = offset, offset + length
    try:
        while pos < end:
            piece = view[: min(len(buf), end - pos)]
            got = _read_full(fd, piece, pos)
            if got < len(piece):
                raise EOFError(f"file ends at byte {pos + got}, before byte {end}")
            value = crc.crc32c(piece, value)
            pos += got
    finally:
        view.release()
    return value


def _read_full(fd: int, piece: memoryview, offset: int) -> int:
    done = 0
    while done < len(piece):
        got = os.preadv(fd, [piece[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done
