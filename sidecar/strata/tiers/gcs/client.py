"""The GCS tier's connection: client construction, object names, error translation, metadata,
reading manifests and checking a stored object against its manifest (no transfer of data).

:class:`GcsBucket` is the base the upload (:mod:`~strata.tiers.gcs.upload`), download
(:mod:`~strata.tiers.gcs.download`) and tier (:mod:`~strata.tiers.gcs.tier`) parts build on.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import BinaryIO, Literal

import requests
import tenacity
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

from strata.config import GcsTierConfig
from strata.errors import ShardCorrupt, ShardUnavailable, TierError
from strata.format import layout
from strata.format.manifest import Manifest
from strata.tiers.base import parse_manifest
from strata.tiers.gcs.errors import (
    GcsBucketNotFound,
    GcsConflict,
    GcsError,
    GcsPermissionDenied,
    GcsUnreachable,
    TransferCorrupt,
)

log = logging.getLogger(__name__)

META_WRITER = "strata-writer-id"
"""Custom metadata key: the writer id (StrataConfig.writer_id) that created the object."""
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


def transit_retry(
    damaged: type[Exception], on_retry: Callable[[BaseException | None], None]
) -> tenacity.Retrying:
    """A download tried up to :data:`TRANSFER_ATTEMPTS` times in a row (``tenacity``), again only
    when it raised ``damaged``: its bytes were damaged in transit (``DataCorruption`` from the
    client, :class:`TransitMismatch` from a range checked against its manifest); the last such
    error is raised. ``on_retry(error)`` is called before each new try (to log it)."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(damaged),
        stop=tenacity.stop_after_attempt(TRANSFER_ATTEMPTS),
        before_sleep=lambda state: on_retry(state.outcome.exception() if state.outcome else None),
        reraise=True,
    )


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


class GcsBucket:
    """A bucket and prefix holding checkpoints in the common layout; the shared state of the GCS
    tier's parts (see :class:`strata.tiers.gcs.tier.GcsTier` for the arguments)."""

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

    def delete_listed(self, blob: storage.Blob) -> Literal["deleted", "gone", "rewritten"]:
        """Delete ``blob`` only while it is the generation that was listed
        (``ifGenerationMatch``; retried, being conditional): "deleted"; "gone" when it no longer
        exists; "rewritten" when a newer generation replaced it since (kept). Other errors are
        raised as google-cloud-storage raises them."""
        try:
            blob.delete(
                if_generation_match=blob.generation,
                retry=self._cond_retry,
                timeout=self.request_timeout,
            )
        except gexc.NotFound:
            return "gone"
        except gexc.PreconditionFailed:
            return "rewritten"
        return "deleted"

    def create_object(
        self,
        blob: storage.Blob,
        payload: bytes | BinaryIO,
        *,
        content_type: str,
        size: int | None = None,
    ) -> bool:
        """Create ``blob`` from ``payload`` (bytes, or the first ``size`` bytes of a binary file)
        only if no object of that name exists (``ifGenerationMatch=0``; so retried: the retry of
        a create that landed gets 412), with a CRC32C the server checks. True: created; False:
        the name exists (412: the caller decides whether what is there is the same). Other errors
        are raised as google-cloud-storage raises them (:class:`DataCorruption` on a CRC32C
        mismatch in transit); wrap the call in :meth:`_errors`."""
        try:
            if isinstance(payload, bytes):
                blob.upload_from_string(
                    payload,
                    content_type=content_type,
                    if_generation_match=0,
                    checksum="crc32c",
                    retry=self._cond_retry,
                    timeout=self.request_timeout,
                )
            else:
                blob.upload_from_file(
                    payload,
                    size=size,
                    content_type=content_type,
                    if_generation_match=0,
                    checksum="crc32c",
                    retry=self._cond_retry,
                    timeout=self.request_timeout,
                )
        except gexc.PreconditionFailed:
            return False
        return True

    def close(self) -> None:
        """Close the HTTP connections of a client this tier created."""
        if self._own_client:
            self._client.close()

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

        def download() -> bytes:
            with self._errors("reading manifest", name, missing=ShardUnavailable):
                data: bytes = self._bucket.blob(name).download_as_bytes(
                    checksum="crc32c", retry=self._retry, timeout=self.request_timeout
                )
            return data

        try:
            # The client compares the server's CRC32C header with what arrived (DataCorruption).
            retrying = transit_retry(
                DataCorruption,
                lambda _: log.warning("%s damaged in transit; downloading it again", where),
            )
            raw = retrying(download)
        except DataCorruption as exc:
            raise TransferCorrupt(
                f"{where}: damaged in transit in {TRANSFER_ATTEMPTS} downloads (CRC32C "
                "differs from the server's); check the network path or proxy"
            ) from exc
        return parse_manifest(raw, where, job_id, step, rank, " and gcs.prefix")

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        """Check the stored data object against the manifest without downloading it.

        Compares the object's size and server-computed CRC32C with ``data_nbytes`` and
        ``crc32c``. Raises :class:`ShardUnavailable` (no manifest or no data object) or
        :class:`ShardCorrupt` (mismatch); returns the manifest.
        """
        manifest = self.get_manifest(job_id, step, rank)
        self._check_blob(
            self.committed_data(job_id, step, rank, "verifying"), manifest, "stored object"
        )
        return manifest

    def committed_data(self, job_id: str, step: int, rank: int, doing: str) -> storage.Blob:
        """The data object (its metadata: size, CRC32C, generation) of a shard whose manifest
        is committed. Raises :class:`ShardCorrupt` when it is missing under that manifest (the
        caller quarantines and falls back), :class:`ShardUnavailable` when it cannot be read;
        ``doing`` names the operation in errors ("verifying", "downloading")."""
        name = self.object_name(layout.data_key(job_id, step, rank))
        with self._errors(doing, name, missing=ShardUnavailable):
            blob = self._bucket.get_blob(name, retry=self._retry, timeout=self.request_timeout)
        if blob is None:
            raise ShardCorrupt(
                f"gs://{self.bucket_name}/{name} is missing although its manifest is committed; "
                "quarantine the manifest and restore from another tier"
            )
        return blob

    def _check_blob(self, blob: storage.Blob, manifest: Manifest, what: str) -> None:
        crc = crc32c_of_b64(blob.crc32c)
        if blob.size != manifest.data_nbytes or crc != manifest.crc32c:
            raise ShardCorrupt(
                f"gs://{self.bucket_name}/{blob.name}: {what} has {blob.size} bytes, crc32c "
                f"{crc}; its manifest records {manifest.data_nbytes} bytes, crc32c "
                f"{manifest.crc32c}. Quarantine it and restore from another tier"
            )
