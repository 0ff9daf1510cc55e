"""The Google Cloud Storage tier: ``gs://<bucket>/<prefix>/<job id>/steps/<step>/rank-RRRRR.*``.

Commit protocol (docs/architecture.md "Commit protocol"), in the order :meth:`GcsTier.put_shard`
runs it:

1. Upload the data object ``rank-RRRRR.data`` (the first ``manifest.data_nbytes`` bytes of the
   local source file) with ``if_generation_match=0`` (create only, never overwrite) and a CRC32C
   checked against the server's. Shards up to 8 MiB go up in one simple (JSON multipart) upload
   of the client. Larger ones up to ``parallel_threshold_bytes`` (150 MiB) stream from the file
   in ONE request of a resumable session (:mod:`strata.tiers.gcs.stream`: 1 MiB blocks, each
   manifest chunk checked as it is read, so a corrupt source never becomes an object). Larger
   shards are a *parallel composite upload*: parts of at least ``chunk_size_bytes`` holding
   whole manifest chunks (at most 32 of them) are streamed the same way concurrently by
   ``max_workers`` threads as temporary objects ``rank-RRRRR.data.part-<tag>-NNNNN``, each with
   ``if_generation_match=0``, then composed server-side into the data object with ``if_generation_match=0`` and
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

Emulator caveat (docs/architecture.md "Decisions"): fake-gcs-server enforces preconditions on
simple uploads only; it
ignores them on resumable uploads, compose, copy and delete, so its silence there proves nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC, datetime

from google.api_core import exceptions as gexc
from google.cloud import storage

from strata.config import TierName
from strata.errors import ShardUnavailable
from strata.format import layout
from strata.tiers.base import StepListing, Tier
from strata.tiers.gcs.client import (
    _QUARANTINE_TS,
    _STORAGE_MAX_REASON,
    META_KIND,
    META_QUARANTINE_REASON,
    META_WORLD_SIZE,
    PART_MARKER,
    _updated,
)
from strata.tiers.gcs.download import GcsDownloader
from strata.tiers.gcs.records import GcsRecords
from strata.tiers.gcs.upload import GcsUploader

log = logging.getLogger(__name__)


class GcsTier(GcsUploader, GcsDownloader, GcsRecords, Tier):
    """Checkpoints in a GCS bucket, in the common layout under ``config.prefix``.

    ``writer_id`` is stamped into every object's metadata (``strata-writer-id``) and decides what
    :meth:`gc_incomplete` may delete. ``client`` overrides :func:`make_client` (it is then not
    closed by :meth:`close`). ``retry_timeout``: seconds a retried call may take in total before
    it fails (default 120 s, GCS's DEFAULT_RETRY); ``request_timeout``: seconds per HTTP request.
    ``verify_threads``: threads checksumming a downloaded shard.
    """

    name: TierName = "gcs"
    put_checks_written = True  # put_shard compares the stored object's CRC32C with the manifest

    def __enter__(self) -> GcsTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- listing -------------------------------------------------------------------------------

    def list_jobs(self) -> list[str]:
        """Job ids with at least one object under ``<prefix>/<job>/steps/``, sorted."""
        root = self.object_name("")
        jobs: set[str] = set()
        with self._errors("listing", root or None):
            it = self.client.list_blobs(
                self.bucket_name, prefix=root, delimiter="/", timeout=self.request_timeout
            )
            for _ in it:  # prefixes fill in while pages are read
                pass
            for p in it.prefixes:
                job = p[len(root) :].rstrip("/")
                if job:
                    jobs.add(job)
        # A job is a prefix holding <job>/steps/ (cheap check: one object under it).
        out = []
        for job in sorted(jobs):
            blobs = self.client.list_blobs(
                self.bucket_name,
                prefix=self.object_name(layout.steps_prefix(job)) + "/",
                max_results=1,
                timeout=self.request_timeout,
            )
            if any(True for _ in blobs):
                out.append(job)
        return out

    def _scan(
        self, job_id: str, step: int | None = None, stem: str = ""
    ) -> dict[int, dict[str, storage.Blob]]:
        """Every object under ``<prefix>/<job>/steps/`` (or only ``step``'s, or only the
        objects of ``step`` whose name starts with ``stem``, e.g. ``rank-00042.``), as
        {step: {file name: blob}}."""
        base = self.object_name(layout.steps_prefix(job_id)) + "/"
        prefix = (
            base if step is None else self.object_name(layout.step_key(job_id, step)) + "/" + stem
        )
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
            has_commit=layout.COMMIT_NAME in objects,
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

    def step_numbers(self, job_id: str) -> list[int]:
        """Steps of ``job_id`` holding any object: one delimiter listing of ``steps/`` (the
        server returns one prefix per step, 1,000 a page), never the steps' objects."""
        base = self.object_name(layout.steps_prefix(job_id)) + "/"
        with self._errors("listing", base):
            pages = self._client.list_blobs(
                self._bucket,
                prefix=base,
                delimiter="/",
                retry=self._retry,
                timeout=self.request_timeout,
            )
            for _ in pages:  # objects directly under steps/ (none in the layout)
                pass
            prefixes = set(pages.prefixes)
        steps = (layout.parse_step(p[len(base) :].rstrip("/")) for p in prefixes)
        return sorted(s for s in steps if s is not None)

    def list_step(self, job_id: str, step: int) -> StepListing | None:
        """One step's objects (a prefix listing of that step alone)."""
        listing = self._listing(job_id, step, self._scan(job_id, step).get(step, {}))
        return listing if listing.committed_ranks or listing.partial_ranks else None

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
        stems = None if ranks is None else {layout.shard_stem(r) for r in ranks}
        if stems is None:
            objects = self._scan(job_id, step).get(step, {})
        else:
            # Only these ranks' objects: one listing per rank prefix, never the whole step
            # (W ranks), so a sidecar's retention costs O(its own ranks).
            objects = {}
            for stem in sorted(stems):
                objects.update(self._scan(job_id, step, stem + ".").get(step, {}))
            name = self.object_name(layout.commit_key(job_id, step))
            if any(
                (p := layout.parse_shard(f)) is not None and p[1] == "manifest" for f in objects
            ):
                with self._errors("reading", name, missing=ShardUnavailable):
                    blob = self._bucket.get_blob(
                        name, retry=self._retry, timeout=self.request_timeout
                    )
                if blob is not None:
                    objects[layout.COMMIT_NAME] = blob
        manifests: list[storage.Blob] = []
        others: list[storage.Blob] = []
        for fname, blob in objects.items():
            if stems is not None and fname.split(".", 1)[0] not in stems:
                continue
            parsed = layout.parse_shard(fname)
            (manifests if parsed is not None and parsed[1] == "manifest" else others).append(blob)
        commit = objects.get(layout.COMMIT_NAME)
        if manifests and commit is not None and commit not in others:
            others.append(commit)
        # The global commit record goes first: the step is no longer complete.
        first = [b for b in others if b is commit]
        for blob in [*first, *manifests, *(b for b in others if b is not commit)]:
            with self._errors("deleting", blob.name, missing=ShardUnavailable):
                if self.delete_listed(blob) == "rewritten":
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
                    if self.delete_listed(blob) != "deleted":
                        continue
                deleted.append(f"gs://{self.bucket_name}/{blob.name}")
        if deleted:
            log.info("garbage-collected %d uncommitted objects of %s", len(deleted), job_id)
        return deleted
