"""Uploading a shard to GCS: create-only data object (simple or parallel composite upload),
checked against the manifest, then the manifest LAST (the commit; see the package docstring)."""

from __future__ import annotations

import logging
import math
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from google.api_core import exceptions as gexc
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption

from strata import faults
from strata.errors import ManifestError, ShardCorrupt, ShardUnavailable, TierError
from strata.format import layout
from strata.format.manifest import Manifest
from strata.tiers.gcs.client import (
    _PART_ALIGN,
    MAX_COMPOSE_SOURCES,
    META_DATA_GENERATION,
    META_WORLD_SIZE,
    META_WRITER,
    PART_MARKER,
    GcsBucket,
    crc32c_of_b64,
)
from strata.tiers.gcs.errors import (
    AlreadyExists,
    GcsConflict,
    GcsUnreachable,
    SourceCorrupt,
    TransferCorrupt,
    TransitMismatch,
)
from strata.tiers.gcs.stream import CheckedBody, range_crc32c, upload_range

log = logging.getLogger(__name__)

SIMPLE_UPLOAD_MAX_BYTES = 8 * 1024 * 1024
"""Shards up to this size go up in one multipart request of the client (it holds them in
memory; the client's own limit for that kind of upload). Larger ones stream from the file in
1 MiB blocks (:mod:`strata.tiers.gcs.stream`), one request per object or composite part, so
an upload holds at most ``max_workers`` blocks whatever the shard size (failure 6:
the client's resumable uploads read ``chunk_size`` bytes at a time, and the sidecar's memory
grew with the shard); see README "Sidecar memory"."""


class GcsUploader(GcsBucket):
    """The write path of the GCS tier."""

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
                if nbytes > max(self.config.chunk_size_bytes, self.config.parallel_threshold_bytes):
                    blob = self._upload_composite(src, name, manifest)
                elif nbytes > SIMPLE_UPLOAD_MAX_BYTES:
                    try:
                        blob = self._upload_streamed(src, 0, nbytes, name, manifest, "data")
                    except gexc.PreconditionFailed as exc:
                        raise AlreadyExists(name) from exc
                else:
                    blob = self._bucket.blob(name)
                    blob.metadata = self._meta("data")
                    with open(src, "rb") as f:
                        created = self.create_object(
                            blob, f, size=nbytes, content_type="application/octet-stream"
                        )
                    if not created:
                        raise AlreadyExists(name)
        except DataCorruption as exc:
            raise GcsUnreachable(
                f"uploading gs://{self.bucket_name}/{name}: corrupted in transit ({exc}); "
                "retry the promotion"
            ) from exc
        except AlreadyExists:
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

    def _upload_composite(self, src: Path, name: str, manifest: Manifest) -> storage.Blob:
        nbytes = manifest.data_nbytes
        # Parts hold whole manifest chunks, so each part checks every chunk it sends.
        align = math.lcm(_PART_ALIGN, manifest.chunk_size)
        part_size = (
            math.ceil(
                max(self.config.chunk_size_bytes, math.ceil(nbytes / MAX_COMPOSE_SOURCES)) / align
            )
            * align
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
                        self._upload_part,
                        src,
                        off,
                        length,
                        f"{name}{PART_MARKER}{tag}-{i:05d}",
                        manifest,
                    )
                    for i, (off, length) in enumerate(ranges)
                ]
                wait(futures)
            # A corrupt source first: it decides what the caller does (quarantine the source).
            errors = sorted(
                (e for f in futures if (e := f.exception()) is not None),
                key=lambda e: not isinstance(e, SourceCorrupt),
            )
            uploaded = [f.result() for f in futures if f.exception() is None]
            if errors:
                raise errors[0]
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
                raise AlreadyExists(name) from exc
            return final
        finally:
            for part in uploaded:
                self._delete_quietly(part)

    def _upload_part(
        self, src: Path, offset: int, length: int, name: str, manifest: Manifest
    ) -> storage.Blob:
        try:
            return self._upload_streamed(src, offset, length, name, manifest, "part")
        except gexc.PreconditionFailed:
            # Part names are unique to this attempt: a 412 is our own retried upload.
            with open(src, "rb") as raw:
                expected = range_crc32c(raw.fileno(), offset, length)
            landed = self._bucket.get_blob(name, retry=self._retry, timeout=self.request_timeout)
            if landed is None or crc32c_of_b64(landed.crc32c) != expected:
                raise
            return landed

    def _upload_streamed(
        self, src: Path, offset: int, length: int, name: str, manifest: Manifest, kind: str
    ) -> storage.Blob:
        """Bytes ``[offset, offset + length)`` of ``src`` as the new object ``name`` in one
        streamed, checked request (:mod:`strata.tiers.gcs.stream`). Raises
        :class:`SourceCorrupt` (no object made), :class:`GcsUnreachable` (damaged in transit:
        the object was deleted) and the client's errors (``PreconditionFailed``: it exists)."""
        blob = self._bucket.blob(name)
        blob.metadata = self._meta(kind)
        blob.content_type = "application/octet-stream"
        with open(src, "rb") as f:
            body = CheckedBody(
                f.fileno(),
                offset,
                length,
                manifest.chunk_size,
                manifest.chunk_crc32c or [],
                str(src),
            )
            try:
                return upload_range(
                    self._client,
                    blob,
                    body,
                    request_timeout=self.request_timeout,
                    deadline=self.retry_timeout,
                )
            except TransitMismatch as exc:
                self._delete_quietly(blob)
                raise GcsUnreachable(
                    f"uploading gs://{self.bucket_name}/{name}: corrupted in transit ({exc}); "
                    "the object was deleted, retry the promotion"
                ) from exc

    def _delete_quietly(self, blob: storage.Blob) -> None:
        try:
            self.delete_listed(blob)
        except Exception as exc:  # cleanup only: leftovers are garbage-collected later
            log.warning("could not delete gs://%s/%s: %s", self.bucket_name, blob.name, exc)

    def _put_manifest(
        self, job_id: str, step: int, rank: int, manifest: Manifest, data_generation: int
    ) -> None:
        faults.point("gcs.data_uploaded")
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
                if not self.create_object(
                    blob, manifest.to_json(), content_type="application/json"
                ):
                    raise AlreadyExists(name)
        except AlreadyExists as exc:
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


def _same_shard(a: Manifest, b: Manifest) -> bool:
    """Same bytes and identity (two manifests of one shard may differ in writer and time)."""
    return (
        a.crc32c == b.crc32c
        and a.data_nbytes == b.data_nbytes
        and a.chunk_size == b.chunk_size
        and a.chunk_crc32c == b.chunk_crc32c
        and a.world_size == b.world_size
    )
