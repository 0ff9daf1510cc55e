"""The Google Cloud Storage tier: ``gs://<bucket>/<prefix>/<job id>/steps/<step>/rank-RRRRR.*``.

Commit protocol (DESIGN.md "GCS"), in the order :meth:`GcsTier.put_shard` runs it:

1. Upload the data object ``rank-RRRRR.data`` (the first ``manifest.data_nbytes`` bytes of the
   local source file) with ``if_generation_match=0`` (create only, never overwrite) and a CRC32C
   the client checks against the server's. Shards up to ``chunk_size_bytes`` go up in one simple
   (JSON multipart) upload. Larger shards are a *parallel composite upload*: parts of at least
   ``chunk_size_bytes`` (at most 32 of them) are uploaded concurrently by ``max_workers`` threads
   as temporary objects ``rank-RRRRR.data.part-<tag>-NNNNN``, each with ``if_generation_match=0``
   and CRC32C, then composed server-side into the data object with ``if_generation_match=0`` and
   ``if_source_generation_match`` pinned to the parts' generations, and the parts deleted. This is
   what ``gcloud storage`` does for large files. It is used instead of transfer_manager's
   ``upload_chunks_concurrently`` (XML multipart API) because that API accepts no preconditions
   (https://cloud.google.com/storage/docs/multipart-uploads: "Preconditions are not supported"),
   always uploads the whole file (a RAM slot file is longer than its shard), and fake-gcs-server
   does not implement it (fsouza/fake-gcs-server#852), so it could not be tested for real.
2. Compare the stored object's ``crc32c`` and size with the manifest. A mismatch means the
   *source* differs from its manifest: the fresh object is deleted and :class:`SourceCorrupt`
   raised (quarantine the source, promote from another tier).
3. Upload the manifest object ``rank-RRRRR.manifest`` LAST, also with ``if_generation_match=0``.
   Its existence is the commit. Returning from ``put_shard`` is the commit point.

Idempotency: every mutating call carries a generation precondition, so it is retried (408, 429,
5xx, connection errors; exponential backoff: ``google.cloud.storage.retry.DEFAULT_RETRY`` wrapped
in a ``ConditionalRetryPolicy``) and an unconditional call is never retried. A 412 on the retry
of an upload that did land is success when the stored object has the expected size and CRC32C;
otherwise the object belongs to another writer and :class:`GcsConflict` is raised (the one
exception: an *uncommitted* data object this same writer left behind, e.g. a different attempt of
the same step after a restart, is replaced).

Ownership: every object carries custom metadata ``strata-writer-id``. Garbage collection
(:meth:`GcsTier.gc_incomplete`) deletes only uncommitted objects of this writer (unless told
otherwise); retention (:meth:`GcsTier.delete_step`) deletes whole complete steps regardless.

Reading: :meth:`GcsTier.fetch_shard` first compares the stored object's size and CRC32C with the
manifest, then downloads byte ranges (aligned to the manifest's checksum chunks, pinned to one
object generation) in parallel threads straight into the destination, checking each chunk's
CRC32C as it completes. transfer_manager's ``download_chunks_concurrently`` is not used because it
truncates the destination (a pre-faulted RAM slot must keep its size) and checks only the whole
object's CRC after the fact. A copy that fails verification is quarantined by
:meth:`GcsTier.quarantine`: manifest (un-commit) then data are copied to
``<name>.quarantined-<UTC time>`` and the originals deleted.

Endpoint and credentials: ``GcsTierConfig.endpoint`` or ``STORAGE_EMULATOR_HOST`` select an
emulator endpoint; a plain ``http://`` endpoint gets anonymous credentials (fake-gcs-server),
anything else Application Default Credentials (workload identity on GKE).

Emulator caveat (DESIGN.md): fake-gcs-server enforces preconditions on simple uploads only; it
ignores them on resumable uploads, compose, copy and delete, so its silence there proves nothing.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import google_crc32c
import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption
from google.cloud.storage.retry import (
    DEFAULT_RETRY,
    ConditionalRetryPolicy,
    is_generation_specified,
)

from strata import layout
from strata.config import GcsTierConfig, TierName
from strata.crc import combine_chunks, crc32c
from strata.manifest import Manifest, ManifestError
from strata.tiers.base import (
    ShardCorrupt,
    ShardUnavailable,
    StepListing,
    Tier,
    TierError,
    TierFull,
    parse_manifest,
)

log = logging.getLogger(__name__)

META_WRITER = "strata-writer-id"
"""Custom metadata key: the writer id (SidecarConfig.writer_id) that created the object."""
META_KIND = "strata-kind"
"""Custom metadata key: ``data``, ``part``, ``manifest`` or ``quarantined``."""
META_WORLD_SIZE = "strata-world-size"
"""Custom metadata key on manifest objects, so listing a step needs no manifest download."""
META_DATA_GENERATION = "strata-data-generation"
"""Custom metadata key on manifest objects: generation of the data object it commits."""
META_QUARANTINE_REASON = "strata-quarantine-reason"

PART_MARKER = ".part-"
"""Temporary part objects of a composite upload: ``rank-RRRRR.data.part-<tag>-NNNNN``."""
MAX_COMPOSE_SOURCES = 32
"""Compose accepts at most 32 source objects per request (GCS quota)."""
_PART_ALIGN = 256 * 1024
_STORAGE_MAX_REASON = 1024
_QUARANTINE_TS = "%Y%m%dT%H%M%S%fZ"
TRANSFER_ATTEMPTS = 3
"""Downloads of a range (or manifest) whose bytes fail their CRC32C before giving up."""


class GcsError(TierError):
    """A GCS call failed; the message names ``gs://bucket/object`` and what to do."""


class GcsBucketNotFound(GcsError):
    """The bucket does not exist (404 on a bucket-level or upload call)."""


class GcsPermissionDenied(GcsError):
    """401/403 or no usable credentials."""


class GcsUnreachable(GcsError):
    """The endpoint did not answer (connection errors, timeouts, 5xx) after retrying."""


class GcsConflict(GcsError):
    """An object Strata would create exists with other content: another writer holds it."""


class SourceCorrupt(ShardCorrupt):
    """``put_shard``'s source file does not match its manifest; nothing was committed."""


class TransferCorrupt(ShardUnavailable, GcsError):
    """Bytes kept arriving damaged although the stored object verifies server-side.

    A :class:`ShardUnavailable` (fall back to another tier), deliberately not a
    :class:`ShardCorrupt`: the stored copy is fine and must not be quarantined.
    """


def make_client(config: GcsTierConfig, project: str | None = None) -> storage.Client:
    """A storage client for ``config``.

    Endpoint: ``config.endpoint``, else ``$STORAGE_EMULATOR_HOST``, else the real service. An
    ``http://`` endpoint is an emulator and gets anonymous credentials; otherwise Application
    Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, workload identity, gcloud login).
    Raises :class:`GcsPermissionDenied` when no credentials can be found.
    """
    endpoint = config.endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    options = {"api_endpoint": endpoint} if endpoint else None
    try:
        if endpoint and endpoint.startswith("http://"):
            return storage.Client(
                project=project or "strata-emulator",
                credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                client_options=options,
            )
        return storage.Client(project=project, client_options=options)
    except auth_exc.DefaultCredentialsError as exc:
        raise GcsPermissionDenied(
            f"no Google Cloud credentials for gs://{config.bucket}: {exc}. Use workload identity "
            "(the default in a CheckpointPolicy), set GOOGLE_APPLICATION_CREDENTIALS, or set "
            "gcs.endpoint / STORAGE_EMULATOR_HOST to an emulator"
        ) from exc


def crc32c_of_b64(value: str | None) -> int | None:
    """GCS reports CRC32C as base64 of the big-endian 4 bytes; ``'AAAAAA=='`` -> 0."""
    if value is None:
        return None
    return int.from_bytes(base64.b64decode(value), "big")


def _updated(blob: storage.Blob) -> float:
    ts = blob.updated or blob.time_created
    return ts.timestamp() if ts is not None else 0.0


class GcsTier(Tier):
    """Checkpoints in a GCS bucket, in the common layout under ``config.prefix``.

    ``writer_id`` is stamped into every object's metadata (``strata-writer-id``) and decides what
    :meth:`gc_incomplete` may delete. ``client`` overrides :func:`make_client` (it is then not
    closed by :meth:`close`). ``retry_timeout``: seconds a retried call may take in total before
    it fails (default 120 s, GCS's DEFAULT_RETRY); ``request_timeout``: seconds per HTTP request.
    ``verify_threads``: threads checksumming a downloaded shard.
    """

    name: TierName = "gcs"

    def __init__(
        self,
        config: GcsTierConfig,
        *,
        writer_id: str | None = None,
        client: storage.Client | None = None,
        retry_timeout: float = 120.0,
        request_timeout: float = 60.0,
        verify_threads: int = 2,
    ) -> None:
        self.config = config
        self.writer_id = writer_id or socket.gethostname()
        self._own_client = client is None
        self._client = client if client is not None else make_client(config)
        self._bucket = self._client.bucket(config.bucket)
        self.retry_timeout = retry_timeout
        self.request_timeout = request_timeout
        self.verify_threads = verify_threads
        self._retry = DEFAULT_RETRY.with_timeout(retry_timeout)
        # Mutations are retried only when they carry a generation precondition (idempotent).
        self._cond_retry = ConditionalRetryPolicy(
            self._retry, is_generation_specified, ["query_params"]
        )
        prefix = config.prefix.strip("/")
        self._root = f"{prefix}/" if prefix else ""

    # -- names ---------------------------------------------------------------------------------

    @property
    def bucket_name(self) -> str:
        return self.config.bucket

    @property
    def client(self) -> storage.Client:
        return self._client

    @property
    def endpoint(self) -> str:
        return str(self._client._connection.API_BASE_URL)

    def object_name(self, key: str) -> str:
        """Full object name of a layout key (prefix applied)."""
        return self._root + key

    def url(self, key: str) -> str:
        """``gs://bucket/<prefix>/<key>`` of a layout key."""
        return f"gs://{self.bucket_name}/{self.object_name(key)}"

    def data_url(self, job_id: str, step: int, rank: int) -> str:
        return self.url(layout.data_key(job_id, step, rank))

    def manifest_url(self, job_id: str, step: int, rank: int) -> str:
        return self.url(layout.manifest_key(job_id, step, rank))

    def close(self) -> None:
        """Close the HTTP connections of a client this tier created."""
        if self._own_client:
            self._client.close()

    def __enter__(self) -> GcsTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- error translation ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(
        self, action: str, name: str | None, missing: type[TierError] | None = None
    ) -> Iterator[None]:
        """Translate google/requests exceptions into TierError subclasses naming the object.

        ``missing``: the class for a 404 (an absent object); None means a 404 can only be the
        bucket (uploads, listings).
        """
        bucket = f"gs://{self.bucket_name}"
        where = f"{bucket}/{name}" if name else bucket
        try:
            yield
        except TierError:
            raise
        except gexc.NotFound as exc:
            if missing is None:
                raise GcsBucketNotFound(
                    f"{action} {where}: bucket {bucket} does not exist (404 from "
                    f"{self.endpoint}). Create it (gcloud storage buckets create {bucket}) or "
                    "fix gcs.bucket in the CheckpointPolicy"
                ) from exc
            raise missing(
                f"{action} {where}: no such object (or no bucket {bucket}); this tier does "
                "not hold it, use another tier"
            ) from exc
        except (gexc.Forbidden, gexc.Unauthorized, auth_exc.RefreshError) as exc:
            raise GcsPermissionDenied(
                f"{action} {where}: permission denied ({exc}). Grant the sidecar's service "
                f"account roles/storage.objectUser on {bucket} (workload identity: bind the "
                "Kubernetes service account to it) or fix the credentials"
            ) from exc
        except gexc.PreconditionFailed as exc:
            raise GcsConflict(
                f"{action} {where}: the object changed concurrently (412 {exc.message}); "
                "another writer is using this prefix"
            ) from exc
        except (
            gexc.RetryError,
            gexc.ServerError,
            gexc.TooManyRequests,
            requests.ConnectionError,
            requests.Timeout,
            auth_exc.TransportError,
            ConnectionError,
            TimeoutError,
        ) as exc:
            raise GcsUnreachable(
                f"{action} {where}: endpoint {self.endpoint} did not answer after retrying for "
                f"up to {self.retry_timeout:.0f}s ({type(exc).__name__}: {exc}). Check the "
                "network, gcs.endpoint / STORAGE_EMULATOR_HOST, and the GCS status page; the "
                "previous checkpoints are untouched"
            ) from exc
        except gexc.GoogleAPICallError as exc:
            raise GcsError(f"{action} {where}: {exc}") from exc

    def _meta(self, kind: str, **extra: str) -> dict[str, str]:
        return {META_WRITER: self.writer_id, META_KIND: kind, **extra}

    def _is_mine(self, blob: storage.Blob) -> bool:
        return (blob.metadata or {}).get(META_WRITER) == self.writer_id

    # -- listing -------------------------------------------------------------------------------

    def _scan(self, job_id: str, step: int | None = None) -> dict[int, dict[str, storage.Blob]]:
        """Every object under ``<prefix>/<job>/steps/`` (or only ``step``'s), as
        {step: {file name: blob}}."""
        base = self.object_name(layout.steps_prefix(job_id)) + "/"
        prefix = base if step is None else self.object_name(layout.step_key(job_id, step)) + "/"
        out: dict[int, dict[str, storage.Blob]] = {}
        with self._errors("listing", prefix):
            for blob in self._client.list_blobs(
                self._bucket, prefix=prefix, retry=self._retry, timeout=self.request_timeout
            ):
                step_dir, _, fname = blob.name[len(base) :].partition("/")
                step = layout.parse_step(step_dir)
                if step is None or not fname or "/" in fname:
                    continue
                out.setdefault(step, {})[fname] = blob
        return out

    def _listing(self, job_id: str, step: int, objects: dict[str, storage.Blob]) -> StepListing:
        committed: set[int] = set()
        data: set[int] = set()
        world_size: int | None = None
        for fname, blob in objects.items():
            parsed = layout.parse_shard(fname)
            if parsed is None:
                continue
            rank, kind = parsed
            if kind == "manifest":
                committed.add(rank)
                if world_size is None:
                    with contextlib.suppress(KeyError, ValueError, TypeError):
                        world_size = int((blob.metadata or {})[META_WORLD_SIZE])
            else:
                data.add(rank)
        if world_size is None and committed:
            # A manifest written by another tool (no metadata): read one.
            with contextlib.suppress(ShardUnavailable):
                world_size = self.get_manifest(job_id, step, min(committed)).world_size
        mtime = max((_updated(b) for b in objects.values()), default=None)
        return StepListing(
            step=step,
            committed_ranks=frozenset(committed),
            partial_ranks=frozenset(data - committed),
            world_size=world_size,
            mtime=mtime,
        )

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        """Steps of ``job_id`` with a data object or manifest (one prefix listing).

        ``world_size`` comes from the manifest objects' ``strata-world-size`` metadata (one
        manifest download when absent); ``mtime`` is the newest object ``updated`` time.
        Raises :class:`GcsBucketNotFound`, :class:`GcsPermissionDenied`, :class:`GcsUnreachable`.
        """
        result: dict[int, StepListing] = {}
        for step, objects in sorted(self._scan(job_id).items()):
            listing = self._listing(job_id, step, objects)
            if listing.committed_ranks or listing.partial_ranks:
                result[step] = listing
        return result

    # -- reading -------------------------------------------------------------------------------

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        """The committed manifest of the shard.

        Raises :class:`ShardUnavailable` (absent; or of another job or format version: skipped,
        never quarantined) or :class:`ShardCorrupt` (malformed, or naming another step/rank
        than its object name: quarantine it).
        """
        key = layout.manifest_key(job_id, step, rank)
        name = self.object_name(key)
        where = self.url(key)
        for attempt in range(1, TRANSFER_ATTEMPTS + 1):
            try:
                with self._errors("reading manifest", name, missing=ShardUnavailable):
                    raw = self._bucket.blob(name).download_as_bytes(
                        checksum="crc32c", retry=self._retry, timeout=self.request_timeout
                    )
                break
            except DataCorruption as exc:
                # The client compares the server's CRC32C header with what arrived.
                if attempt == TRANSFER_ATTEMPTS:
                    raise TransferCorrupt(
                        f"{where}: damaged in transit in {TRANSFER_ATTEMPTS} downloads (CRC32C "
                        "differs from the server's); check the network path or proxy"
                    ) from exc
                log.warning("%s damaged in transit; downloading it again", where)
        return parse_manifest(raw, where, job_id, step, rank, " and gcs.prefix")

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        """Check the stored data object against the manifest without downloading it.

        Compares the object's size and server-computed CRC32C with ``data_nbytes`` and
        ``crc32c``. Raises :class:`ShardUnavailable` (no manifest or no data object) or
        :class:`ShardCorrupt` (mismatch); returns the manifest.
        """
        manifest = self.get_manifest(job_id, step, rank)
        name = self.object_name(layout.data_key(job_id, step, rank))
        with self._errors("verifying", name, missing=ShardUnavailable):
            blob = self._bucket.get_blob(name, retry=self._retry, timeout=self.request_timeout)
        if blob is None:
            raise ShardCorrupt(
                f"gs://{self.bucket_name}/{name} is missing although its manifest is committed; "
                "quarantine the manifest and restore from another tier"
            )
        self._check_blob(blob, manifest, "stored object")
        return manifest

    def _check_blob(self, blob: storage.Blob, manifest: Manifest, what: str) -> None:
        crc = crc32c_of_b64(blob.crc32c)
        if blob.size != manifest.data_nbytes or crc != manifest.crc32c:
            raise ShardCorrupt(
                f"gs://{self.bucket_name}/{blob.name}: {what} has {blob.size} bytes, crc32c "
                f"{crc}; its manifest records {manifest.data_nbytes} bytes, crc32c "
                f"{manifest.crc32c}. Quarantine it and restore from another tier"
            )

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
        with self._errors("downloading", name, missing=ShardUnavailable):
            stored = self._bucket.get_blob(name, retry=self._retry, timeout=self.request_timeout)
        if stored is None:
            raise ShardCorrupt(
                f"{where} is missing although its manifest is committed; quarantine the "
                "manifest and restore from another tier"
            )
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
                for attempt in range(1, TRANSFER_ATTEMPTS + 1):
                    sink.reset()
                    try:
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
                        return
                    except _TransitMismatch as exc:
                        # The stored object's CRC32C matched the manifest, so these bytes were
                        # damaged on the way: fetch the range again, never quarantine for it.
                        if attempt == TRANSFER_ATTEMPTS:
                            raise TransferCorrupt(
                                f"{exc} in {TRANSFER_ATTEMPTS} downloads, although the stored "
                                "object's CRC32C matches its manifest: the bytes are damaged in "
                                "transit (check the network path or proxy); the stored copy is "
                                "kept, restore from another tier meanwhile"
                            ) from None
                        log.warning("%s; downloading the range again", exc)

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
                errors.sort(key=lambda e: isinstance(e, _Aborted))
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

    # -- writing -------------------------------------------------------------------------------

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        """Commit a shard: data object (CRC32C-checked) then manifest object, both create-only.

        ``src_path`` may be longer than ``manifest.data_nbytes`` (a RAM slot file); only that
        prefix is uploaded. The manifest must carry its checksums (``manifest.verified``).
        The source is read once: GCS's CRC32C of what it stored is compared with the manifest
        (``verify_source`` is accepted for parity with the POSIX tiers; this check always runs,
        it costs no extra read). Returns the data bytes uploaded; 0 when this exact shard is
        already committed here (nothing is uploaded). Raises :class:`SourceCorrupt` (the source
        does not match its manifest; nothing committed), :class:`ShardCorrupt` (this shard is
        committed here but its stored copy is bad: quarantine it, then promote again),
        :class:`GcsConflict` (another writer holds the objects), :class:`GcsBucketNotFound`,
        :class:`GcsPermissionDenied`, :class:`GcsUnreachable`. On error nothing is committed;
        a partial data object may stay until :meth:`gc_incomplete` removes it.
        """
        try:
            manifest.check_identity(job_id, step, rank, None)
        except ManifestError as exc:
            raise TierError(f"put_shard to {self.manifest_url(job_id, step, rank)}: {exc}") from exc
        if not manifest.verified:
            raise TierError(
                f"put_shard to {self.manifest_url(job_id, step, rank)}: the manifest has no "
                "CRC32C yet; checksum the source before promoting it"
            )
        nbytes = manifest.data_nbytes
        src = Path(src_path)
        try:
            size = src.stat().st_size
        except OSError as exc:
            raise TierError(f"put_shard source {src}: {exc.strerror}") from exc
        if size < nbytes:
            raise SourceCorrupt(
                f"source {src} holds {size} bytes, its manifest records {nbytes} (truncated); "
                f"nothing was uploaded to {self.data_url(job_id, step, rank)}"
            )
        if self._already_committed(job_id, step, rank, manifest):
            return 0
        data_key = layout.data_key(job_id, step, rank)
        blob = self._put_data(src, data_key, manifest, allow_replace=True)
        self._put_manifest(job_id, step, rank, manifest, int(blob.generation or 0))
        return nbytes

    def _already_committed(self, job_id: str, step: int, rank: int, manifest: Manifest) -> bool:
        """True when this exact shard is committed here (and its data object checks out)."""
        try:
            current = self.get_manifest(job_id, step, rank)
        except ShardCorrupt as exc:
            raise GcsConflict(
                f"{self.manifest_url(job_id, step, rank)} exists but is unreadable ({exc}); "
                "quarantine it before promoting this step again"
            ) from exc
        except TransferCorrupt:
            raise
        except ShardUnavailable:
            return False  # absent; an unreadable other-job manifest surfaces as a 412 later
        if not _same_shard(current, manifest):
            raise GcsConflict(
                f"{self.manifest_url(job_id, step, rank)} is already committed with other "
                f"content (writer {current.writer_id!r}, crc32c {current.crc32c}; this shard "
                f"{manifest.crc32c}): another writer holds that object. Strata never overwrites "
                "a committed shard"
            )
        self.verify_shard(job_id, step, rank)
        return True

    def _put_data(
        self, src: Path, key: str, manifest: Manifest, allow_replace: bool
    ) -> storage.Blob:
        name = self.object_name(key)
        nbytes = manifest.data_nbytes
        try:
            with self._errors("uploading", name):
                if nbytes > self.config.chunk_size_bytes:
                    blob = self._upload_composite(src, name, nbytes)
                else:
                    blob = self._bucket.blob(name)
                    blob.metadata = self._meta("data")
                    with open(src, "rb") as f:
                        try:
                            blob.upload_from_file(
                                f,
                                size=nbytes,
                                content_type="application/octet-stream",
                                if_generation_match=0,
                                checksum="crc32c",
                                retry=self._cond_retry,
                                timeout=self.request_timeout,
                            )
                        except gexc.PreconditionFailed as exc:
                            raise _AlreadyExists(name) from exc
        except DataCorruption as exc:
            raise GcsUnreachable(
                f"uploading gs://{self.bucket_name}/{name}: corrupted in transit ({exc}); "
                "retry the promotion"
            ) from exc
        except _AlreadyExists:
            existing = self._existing_data(name, manifest, allow_replace)
            if existing is not None:
                return existing
            return self._put_data(src, key, manifest, allow_replace=False)
        try:
            self._check_blob(blob, manifest, "uploaded object")
        except ShardCorrupt as exc:
            with self._errors("deleting mismatching upload", name, missing=ShardUnavailable):
                blob.delete(
                    if_generation_match=blob.generation,
                    retry=self._cond_retry,
                    timeout=self.request_timeout,
                )
            raise SourceCorrupt(
                f"source {src} does not match its manifest: {exc}. The upload was deleted; "
                "quarantine the source and promote from another tier"
            ) from exc
        return blob

    def _existing_data(
        self, name: str, manifest: Manifest, allow_replace: bool
    ) -> storage.Blob | None:
        """After a 412 on the data object: the existing object if it is the same bytes, None
        after removing a stale uncommitted object of this writer, else :class:`GcsConflict`."""
        with self._errors("inspecting existing", name, missing=ShardUnavailable):
            existing = self._bucket.get_blob(name, retry=self._retry, timeout=self.request_timeout)
        url = f"gs://{self.bucket_name}/{name}"
        if existing is None:
            if allow_replace:
                return None
            raise GcsConflict(
                f"{url} appeared and vanished while uploading: another writer is using this prefix"
            )
        crc = crc32c_of_b64(existing.crc32c)
        if existing.size == manifest.data_nbytes and crc == manifest.crc32c:
            return existing  # a retried upload that did land (or identical bytes): done
        writer = (existing.metadata or {}).get(META_WRITER)
        manifest_name = name[: -len(layout.DATA_SUFFIX)] + layout.MANIFEST_SUFFIX
        with self._errors("inspecting existing", manifest_name, missing=ShardUnavailable):
            committed = self._bucket.get_blob(
                manifest_name, retry=self._retry, timeout=self.request_timeout
            )
        if allow_replace and committed is None and writer == self.writer_id:
            # Our own uncommitted leftover of an earlier attempt at this step: replace it.
            log.info("replacing uncommitted %s left by an earlier attempt of this writer", url)
            with self._errors("replacing stale", name, missing=ShardUnavailable):
                existing.delete(
                    if_generation_match=existing.generation,
                    retry=self._cond_retry,
                    timeout=self.request_timeout,
                )
            return None
        raise GcsConflict(
            f"{url} already exists with other content ({existing.size} bytes, crc32c {crc}, "
            f"writer {writer!r}; this shard has {manifest.data_nbytes} bytes, crc32c "
            f"{manifest.crc32c}): another writer holds that object"
            + (" and committed it" if committed is not None else "")
            + ". Strata never overwrites it; use another prefix or run id, or remove it if "
            "that writer is gone"
        )

    def _upload_composite(self, src: Path, name: str, nbytes: int) -> storage.Blob:
        part_size = max(
            self.config.chunk_size_bytes,
            math.ceil(math.ceil(nbytes / MAX_COMPOSE_SOURCES) / _PART_ALIGN) * _PART_ALIGN,
        )
        tag = uuid.uuid4().hex[:12]
        ranges = [(off, min(part_size, nbytes - off)) for off in range(0, nbytes, part_size)]
        uploaded: list[storage.Blob] = []
        try:
            with ThreadPoolExecutor(
                max_workers=min(self.config.max_workers, len(ranges)),
                thread_name_prefix="strata-gcs-up",
            ) as pool:
                futures: list[Future[storage.Blob]] = [
                    pool.submit(
                        self._upload_part, src, off, length, f"{name}{PART_MARKER}{tag}-{i:05d}"
                    )
                    for i, (off, length) in enumerate(ranges)
                ]
                wait(futures)
            errors = [f.exception() for f in futures if f.exception() is not None]
            uploaded = [f.result() for f in futures if f.exception() is None]
            if errors:
                raise errors[0]  # type: ignore[misc]
            final = self._bucket.blob(name)
            final.metadata = self._meta("data")
            final.content_type = "application/octet-stream"
            try:
                final.compose(
                    uploaded,
                    if_generation_match=0,
                    if_source_generation_match=[p.generation for p in uploaded],
                    retry=self._cond_retry,
                    timeout=self.request_timeout,
                )
            except gexc.PreconditionFailed as exc:
                raise _AlreadyExists(name) from exc
            return final
        finally:
            for part in uploaded:
                self._delete_quietly(part)

    def _upload_part(self, src: Path, offset: int, length: int, name: str) -> storage.Blob:
        blob = self._bucket.blob(name)
        blob.metadata = self._meta("part")
        with open(src, "rb") as raw:
            # A part above the client's 8 MiB multipart limit goes up as a resumable upload,
            # which refuses a stream not at position 0 ("Stream must be at beginning"): give it
            # a view of the range that starts at 0.
            f = _FileRange(raw.fileno(), offset, length)
            try:
                blob.upload_from_file(
                    f,
                    size=length,
                    content_type="application/octet-stream",
                    if_generation_match=0,
                    checksum="crc32c",
                    retry=self._cond_retry,
                    timeout=self.request_timeout,
                )
            except gexc.PreconditionFailed:
                # Part names are unique to this attempt: a 412 is our own retried upload.
                expected = google_crc32c.value(os.pread(raw.fileno(), length, offset))
                landed = self._bucket.get_blob(
                    name, retry=self._retry, timeout=self.request_timeout
                )
                if landed is None or crc32c_of_b64(landed.crc32c) != expected:
                    raise
                return landed
        return blob

    def _delete_quietly(self, blob: storage.Blob) -> None:
        try:
            blob.delete(
                if_generation_match=blob.generation,
                retry=self._cond_retry,
                timeout=self.request_timeout,
            )
        except gexc.NotFound:
            pass
        except Exception as exc:  # cleanup only: leftovers are garbage-collected later
            log.warning("could not delete gs://%s/%s: %s", self.bucket_name, blob.name, exc)

    def _put_manifest(
        self, job_id: str, step: int, rank: int, manifest: Manifest, data_generation: int
    ) -> None:
        key = layout.manifest_key(job_id, step, rank)
        name = self.object_name(key)
        blob = self._bucket.blob(name)
        blob.metadata = self._meta(
            "manifest",
            **{
                META_WORLD_SIZE: str(manifest.world_size),
                META_DATA_GENERATION: str(data_generation),
            },
        )
        try:
            with self._errors("committing manifest", name):
                try:
                    blob.upload_from_string(
                        manifest.to_json(),
                        content_type="application/json",
                        if_generation_match=0,
                        checksum="crc32c",
                        retry=self._cond_retry,
                        timeout=self.request_timeout,
                    )
                except gexc.PreconditionFailed as exc:
                    raise _AlreadyExists(name) from exc
        except _AlreadyExists as exc:
            try:
                existing = self.get_manifest(job_id, step, rank)
            except TransferCorrupt:
                raise
            except ShardUnavailable as inner:
                raise GcsConflict(
                    f"{self.url(key)}: 412 on create but the manifest is unreadable ({inner}); "
                    "another writer is using this prefix"
                ) from exc
            if not _same_shard(existing, manifest):
                raise GcsConflict(
                    f"{self.url(key)} is already committed with other content (writer "
                    f"{existing.writer_id!r}, crc32c {existing.crc32c}; this shard {manifest.crc32c}): "
                    "another writer holds that object. Strata never overwrites a committed shard"
                ) from exc

    # -- un-commit, delete, garbage collection -----------------------------------------------

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        """Move the shard aside: manifest first (un-commit), then data, each copied to
        ``<name>.quarantined-<UTC time>`` (metadata ``strata-quarantine-reason``) and the
        original deleted. A missing object is skipped (quarantining twice is harmless)."""
        ts = datetime.now(UTC).strftime(_QUARANTINE_TS)
        for key in (layout.manifest_key(job_id, step, rank), layout.data_key(job_id, step, rank)):
            name = self.object_name(key)
            with self._errors("quarantining", name, missing=ShardUnavailable):
                blob = self._bucket.get_blob(name, retry=self._retry, timeout=self.request_timeout)
                if blob is None:
                    continue
                aside = self._bucket.blob(f"{name}{layout.QUARANTINE_SUFFIX}-{ts}")
                aside.metadata = {
                    **(blob.metadata or {}),
                    META_KIND: "quarantined",
                    META_QUARANTINE_REASON: reason[:_STORAGE_MAX_REASON],
                }
                token: str | None = None
                while True:
                    token, _, _ = aside.rewrite(
                        blob,
                        token=token,
                        if_generation_match=0,
                        if_source_generation_match=blob.generation,
                        retry=self._cond_retry,
                        timeout=self.request_timeout,
                    )
                    if token is None:
                        break
                with contextlib.suppress(gexc.NotFound):
                    blob.delete(
                        if_generation_match=blob.generation,
                        retry=self._cond_retry,
                        timeout=self.request_timeout,
                    )
            log.warning("quarantined %s: %s", self.url(key), reason)

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        """Delete a step (all objects under it) or some ranks' objects: manifests first
        (un-commit), then data and leftovers. Each delete is pinned to the listed generation; an
        object replaced since the listing is kept (logged)."""
        objects = self._scan(job_id, step).get(step, {})
        stems = None if ranks is None else {layout.shard_stem(r) for r in ranks}
        manifests: list[storage.Blob] = []
        others: list[storage.Blob] = []
        for fname, blob in objects.items():
            if stems is not None and fname.split(".", 1)[0] not in stems:
                continue
            parsed = layout.parse_shard(fname)
            (manifests if parsed is not None and parsed[1] == "manifest" else others).append(blob)
        for blob in [*manifests, *others]:
            with self._errors("deleting", blob.name, missing=ShardUnavailable):
                try:
                    blob.delete(
                        if_generation_match=blob.generation,
                        retry=self._cond_retry,
                        timeout=self.request_timeout,
                    )
                except gexc.NotFound:
                    pass
                except gexc.PreconditionFailed:
                    log.warning(
                        "kept gs://%s/%s: rewritten since listed", self.bucket_name, blob.name
                    )

    def gc_incomplete(
        self,
        job_id: str,
        grace_seconds: float,
        *,
        now: float | None = None,
        any_writer: bool = False,
    ) -> list[str]:
        """Delete uncommitted leftovers (C-08); returns the ``gs://`` URLs deleted.

        Deleted: data objects without their manifest, and part objects of interrupted
        composite uploads, in steps *older than the newest complete step*, whose ``updated`` time
        is more than ``grace_seconds`` before ``now`` (seconds since the epoch; default: now), and
        whose ``strata-writer-id`` is this tier's writer id (any writer with ``any_writer``).
        Never deleted: manifests, the data of a committed shard, quarantined copies, anything in
        the newest complete step or newer (a save may be in flight), anything when no step is
        complete.
        """
        now = time.time() if now is None else now
        scan = self._scan(job_id)
        complete = [s for s, objs in scan.items() if self._listing(job_id, s, objs).complete]
        if not complete:
            return []
        newest = max(complete)
        deleted: list[str] = []
        for step in sorted(s for s in scan if s < newest):
            objects = scan[step]
            committed = {
                p[0] for f in objects if (p := layout.parse_shard(f)) and p[1] == "manifest"
            }
            for fname, blob in objects.items():
                parsed = layout.parse_shard(fname)
                is_part = PART_MARKER in fname and layout.QUARANTINE_SUFFIX not in fname
                uncommitted_data = (
                    parsed is not None and parsed[1] == "data" and (parsed[0] not in committed)
                )
                if not (is_part or uncommitted_data):
                    continue
                if now - _updated(blob) <= grace_seconds:
                    continue
                if not any_writer and not self._is_mine(blob):
                    continue
                with self._errors("garbage-collecting", blob.name, missing=ShardUnavailable):
                    try:
                        blob.delete(
                            if_generation_match=blob.generation,
                            retry=self._cond_retry,
                            timeout=self.request_timeout,
                        )
                    except (gexc.NotFound, gexc.PreconditionFailed):
                        continue
                deleted.append(f"gs://{self.bucket_name}/{blob.name}")
        if deleted:
            log.info("garbage-collected %d uncommitted objects of %s", len(deleted), job_id)
        return deleted


def _same_shard(a: Manifest, b: Manifest) -> bool:
    """Same bytes and identity (two manifests of one shard may differ in writer and time)."""
    return (
        a.crc32c == b.crc32c
        and a.data_nbytes == b.data_nbytes
        and a.chunk_size == b.chunk_size
        and a.chunk_crc32c == b.chunk_crc32c
        and a.world_size == b.world_size
    )


class _FileRange(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream starting at 0."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(0, base + pos), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._offset + self._pos)
        self._pos += got
        return got


class _AlreadyExists(Exception):
    """Internal: a create-only call got 412 (the object exists)."""


class _Aborted(Exception):
    """Internal: another range of the same download failed; stop this one."""


class _TransitMismatch(Exception):
    """Internal: a downloaded range did not match the manifest's chunk CRC32Cs."""


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
            raise _Aborted(self.where)
        view = memoryview(data)
        if self.pos + len(view) > self.end:
            raise _TransitMismatch(f"{self.where}: more bytes arrived than requested")
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
            raise _TransitMismatch(
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
            raise _TransitMismatch(
                f"{self.where}: download of bytes {self.start}-{self.end} ended at {self.pos}"
            )


__all__ = [
    "META_DATA_GENERATION",
    "META_KIND",
    "META_QUARANTINE_REASON",
    "META_WORLD_SIZE",
    "META_WRITER",
    "PART_MARKER",
    "GcsBucketNotFound",
    "GcsConflict",
    "GcsError",
    "GcsPermissionDenied",
    "GcsTier",
    "GcsUnreachable",
    "SourceCorrupt",
    "TransferCorrupt",
    "crc32c_of_b64",
    "make_client",
]
