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

Reading: :meth:`GcsTier.fetch_shard` downloads (in parallel byte ranges with transfer_manager's
``download_chunks_concurrently`` for shards larger than ``chunk_size_bytes``) and verifies the
bytes against the manifest's chunk CRC32Cs. A copy that fails verification is quarantined by
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
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from pathlib import Path

import google_crc32c
import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage import transfer_manager
from google.cloud.storage.exceptions import DataCorruption
from google.cloud.storage.retry import (
    DEFAULT_RETRY,
    ConditionalRetryPolicy,
    is_generation_specified,
)

from strata import layout
from strata.config import GcsTierConfig, TierName
from strata.crc import file_chunk_crcs, first_bad_chunk
from strata.manifest import Manifest, ManifestError
from strata.tiers.base import ShardCorrupt, ShardUnavailable, StepListing, Tier, TierError

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

    def _scan(self, job_id: str) -> dict[int, dict[str, storage.Blob]]:
        """Every object under ``<prefix>/<job>/steps/``, as {step: {file name: blob}}."""
        base = self.object_name(layout.steps_prefix(job_id)) + "/"
        out: dict[int, dict[str, storage.Blob]] = {}
        with self._errors("listing", base):
            for blob in self._client.list_blobs(
                self._bucket, prefix=base, retry=self._retry, timeout=self.request_timeout
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
        """The committed manifest. :class:`ShardUnavailable` when absent, :class:`ShardCorrupt`
        when malformed or of another shard (quarantine it)."""
        key = layout.manifest_key(job_id, step, rank)
        name = self.object_name(key)
        with self._errors("reading manifest", name, missing=ShardUnavailable):
            raw = self._bucket.blob(name).download_as_bytes(
                checksum="crc32c", retry=self._retry, timeout=self.request_timeout
            )
        try:
            manifest = Manifest.from_json(raw, self.url(key))
            manifest.check_identity(job_id, step, rank, None)
        except ManifestError as exc:
            raise ShardCorrupt(f"{self.url(key)}: {exc}; quarantine it") from exc
        return manifest

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
        """Download the data object into ``dst_path`` (created or truncated) and verify it.

        Shards larger than ``chunk_size_bytes`` are downloaded in parallel byte ranges
        (transfer_manager ``download_chunks_concurrently``, threads), which also checks the
        combined CRC32C against the server's. With ``verify`` the file's bytes are checked
        against the manifest's per-chunk CRC32Cs and whole CRC32C. Raises
        :class:`ShardUnavailable` (not committed here), :class:`ShardCorrupt` (mismatch: the
        caller quarantines and falls back) or another :class:`GcsError`.
        """
        manifest = self.get_manifest(job_id, step, rank)
        if verify and not manifest.verified:
            raise ShardCorrupt(
                f"{self.manifest_url(job_id, step, rank)} records no CRC32C; it was not written "
                "by Strata's commit protocol. Quarantine it"
            )
        key = layout.data_key(job_id, step, rank)
        name = self.object_name(key)
        blob = self._bucket.blob(name)
        dst = Path(dst_path)
        try:
            with self._errors("downloading", name, missing=ShardCorrupt):
                if manifest.data_nbytes > self.config.chunk_size_bytes:
                    blob.reload(retry=self._retry, timeout=self.request_timeout)
                    self._check_blob(blob, manifest, "stored object")
                    transfer_manager.download_chunks_concurrently(
                        blob,
                        str(dst),
                        chunk_size=self.config.chunk_size_bytes,
                        download_kwargs={"retry": self._retry, "timeout": self.request_timeout},
                        worker_type=transfer_manager.THREAD,
                        max_workers=self.config.max_workers,
                        crc32c_checksum=True,
                    )
                else:
                    with open(dst, "wb") as f:
                        blob.download_to_file(
                            f, checksum="crc32c", retry=self._retry, timeout=self.request_timeout
                        )
        except DataCorruption as exc:
            raise ShardCorrupt(
                f"{self.url(key)}: download does not match the server's CRC32C ({exc}); "
                "quarantine it and restore from another tier"
            ) from exc
        size = dst.stat().st_size
        if size != manifest.data_nbytes:
            raise ShardCorrupt(
                f"{self.url(key)} holds {size} bytes, its manifest records "
                f"{manifest.data_nbytes}; quarantine it and restore from another tier"
            )
        if verify:
            self._verify_file(dst, manifest, self.url(key))
        return manifest

    def _verify_file(self, path: Path, manifest: Manifest, where: str) -> None:
        crcs, whole = file_chunk_crcs(
            path, manifest.data_nbytes, manifest.chunk_size, threads=self.verify_threads
        )
        expected = manifest.chunk_crc32c or []
        bad = first_bad_chunk(crcs, expected)
        if bad is not None or whole != manifest.crc32c:
            at = f"chunk {bad} (bytes from {bad * manifest.chunk_size})" if bad is not None else ""
            raise ShardCorrupt(
                f"{where}: CRC32C mismatch {at} against its manifest (whole object {whole} != "
                f"{manifest.crc32c}); quarantine it and restore from another tier"
            )

    # -- writing -------------------------------------------------------------------------------

    def put_shard(
        self, job_id: str, step: int, rank: int, src_path: Path, manifest: Manifest
    ) -> int:
        """Commit a shard: data object (CRC32C-checked) then manifest object, both create-only.

        ``src_path`` may be longer than ``manifest.data_nbytes`` (a RAM slot file); only that
        prefix is uploaded. The manifest must carry its checksums (``manifest.verified``).
        Returns the data bytes committed. Raises :class:`SourceCorrupt` (the source does not
        match its manifest; nothing committed), :class:`GcsConflict` (another writer holds the
        objects), :class:`GcsBucketNotFound`, :class:`GcsPermissionDenied`,
        :class:`GcsUnreachable`. On error nothing is committed; a partial data object may stay
        until :meth:`gc_incomplete` removes it.
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
        data_key = layout.data_key(job_id, step, rank)
        blob = self._put_data(src, data_key, manifest, allow_replace=True)
        self._put_manifest(job_id, step, rank, manifest, int(blob.generation or 0))
        return nbytes

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
        with open(src, "rb") as f:
            f.seek(offset)
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
                f.seek(offset)
                expected = google_crc32c.value(f.read(length))
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
            except ShardUnavailable as inner:
                raise GcsConflict(
                    f"{self.url(key)}: 412 on create but the manifest is unreadable ({inner}); "
                    "another writer is using this prefix"
                ) from exc
            same = (
                existing.crc32c == manifest.crc32c
                and existing.data_nbytes == manifest.data_nbytes
                and existing.chunk_crc32c == manifest.chunk_crc32c
                and existing.world_size == manifest.world_size
            )
            if not same:
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
        objects = self._scan(job_id).get(step, {})
        manifests: list[storage.Blob] = []
        others: list[storage.Blob] = []
        for fname, blob in objects.items():
            if ranks is not None:
                stem = fname.split(".", 1)[0]
                if not any(stem == layout.shard_stem(r) for r in ranks):
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


class _AlreadyExists(Exception):
    """Internal: a create-only call got 412 (the object exists)."""


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
    "crc32c_of_b64",
    "make_client",
]
