"""A tier on any POSIX directory: the PVC (Filestore, Lustre, NFS) and, as a base, the RAM tier.

Layout (:mod:`strata.format.layout`): ``<root>/<job>/steps/<step:012d>/rank-<r:05d>.{data,manifest}``.

Commit protocol (docs/architecture.md "Commit protocol"), in :meth:`PosixTier.put_shard`:

1. write the data object from ``src_path``, checking the source against the manifest's CRC32Cs
   in the same pass (:func:`strata.tiers.checked_copy.copy_checked`: each block read once,
   checksummed and written from one buffer, so the bytes checked are the bytes written and no
   read-back is needed; a corrupt RAM copy is never committed), ``fsync`` it. Without
   ``verify_source`` the kernel copies (``os.copy_file_range``, else ``os.sendfile``, else
   read/write);
2. write the manifest to a temporary name, ``fsync`` it, ``rename`` it to ``rank-R.manifest``
   (the commit point), ``fsync`` the step directory.

An ``fsync`` error abandons the attempt: the files this call wrote are removed and
:class:`TierError` is raised; the fsync is never retried ("fsyncgate": after a failed fsync the
page cache may already have dropped the dirty pages, so a second fsync can succeed on lost data).
The caller rewrites from the source tier. ENOSPC / EDQUOT raise :class:`TierFull` naming the path,
after removing only the partial files this call wrote. Committed steps are never touched by a
failed write.

Readers: :meth:`list_steps` (manifest present = committed; data without manifest = partial),
:meth:`get_manifest`, :meth:`fetch_shard` (:func:`copy_checked`, as promotion: every chunk's
CRC32C checked as it is copied), :meth:`quarantine` (renames ``rank-R.manifest``
and ``rank-R.data`` to ``<name>.quarantined-<ts>`` plus a ``.reason`` note: never served again,
kept for inspection).
Retention: :meth:`delete_step` removes manifests first (un-commit), then data.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from pathlib import Path

from strata import faults
from strata.config import TierName
from strata.errors import ShardCorrupt, ShardUnavailable, TierError, TierFull
from strata.format import crc, layout
from strata.format.manifest import Manifest
from strata.tiers.base import StepListing, Tier, parse_manifest
from strata.tiers.durability import fsync_dir, temp_name, write_new
from strata.tiers.posix_io import (
    FULL_ERRNOS,
    copy_verified,
    make_dirs,
    remove_quietly,
    write_data,
)
from strata.tiers.posix_records import PosixRecords

log = logging.getLogger(__name__)


class PosixTier(PosixRecords, Tier):
    """Checkpoints in a POSIX directory ``root`` (see the module docstring for the protocol).

    ``name``: the tier name reported in provenance (``"pvc"``; the RAM tier subclasses this).
    ``fsync``: False only for media where fsync is meaningless (tmpfs). ``verify_threads``:
    threads checksumming a source before promotion.
    """

    name: TierName = "pvc"
    put_checks_written = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        name: TierName = "pvc",
        *,
        fsync: bool = True,
        verify_threads: int = 1,
    ) -> None:
        self.root = Path(root)
        self.name = name
        self.fsync = fsync
        self.verify_threads = verify_threads

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, name={self.name!r})"

    # -- paths ----------------------------------------------------------------------------------

    def step_dir(self, job_id: str, step: int) -> Path:
        return self.root / layout.step_key(job_id, step)

    def local_root(self) -> Path:
        return self.root

    def list_jobs(self) -> list[str]:
        try:
            with os.scandir(self.root) as it:
                return sorted(
                    e.name for e in it if e.is_dir() and (Path(e.path) / "steps").is_dir()
                )
        except OSError as exc:
            raise TierError(f"cannot list {self.root}: {exc.strerror}") from exc

    def data_path(self, job_id: str, step: int, rank: int) -> Path:
        """The data file (a POSIX tier can always be read as files)."""
        return self.root / layout.data_key(job_id, step, rank)

    def manifest_path(self, job_id: str, step: int, rank: int) -> Path:
        return self.root / layout.manifest_key(job_id, step, rank)

    # -- reading --------------------------------------------------------------------------------

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        """Steps of ``job_id`` with any data or manifest; world size from a readable manifest."""
        steps_dir = self.root / layout.steps_prefix(job_id)
        out: dict[int, StepListing] = {}
        try:
            entries = list(os.scandir(steps_dir))
        except FileNotFoundError:
            return out
        except OSError as exc:
            raise TierError(f"cannot list {steps_dir} ({exc.strerror}); check the mount") from exc
        for entry in entries:
            step = layout.parse_step(entry.name)
            if step is None or not entry.is_dir():
                continue
            listing = self._list_step(job_id, step, Path(entry.path))
            if listing is not None:
                out[step] = listing
        return out

    def step_numbers(self, job_id: str) -> list[int]:
        """Steps of ``job_id`` with a directory (one read of ``steps/``, none of the steps)."""
        try:
            names = [
                e.name for e in os.scandir(self.root / layout.steps_prefix(job_id)) if e.is_dir()
            ]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TierError(f"cannot list {self.root} ({exc.strerror}); check the mount") from exc
        return sorted(s for n in names if (s := layout.parse_step(n)) is not None)

    def list_step(self, job_id: str, step: int) -> StepListing | None:
        """One step's directory alone."""
        return self._list_step(job_id, step, self.step_dir(job_id, step))

    def _list_step(self, job_id: str, step: int, d: Path) -> StepListing | None:
        manifests: set[int] = set()
        datas: set[int] = set()
        mtime = 0.0
        has_commit = False
        try:
            files = list(os.scandir(d))
        except FileNotFoundError:  # deleted while listing
            return None
        for f in files:
            parsed = layout.parse_shard(f.name)
            try:
                mtime = max(mtime, f.stat().st_mtime)
            except FileNotFoundError:
                continue
            if parsed is None:
                has_commit = has_commit or f.name == layout.COMMIT_NAME
                continue
            (manifests if parsed[1] == "manifest" else datas).add(parsed[0])
        world_size = None
        for r in sorted(manifests):
            try:
                world_size = self._read_manifest(job_id, step, r).world_size
                break
            except ShardUnavailable:
                continue
        if not manifests and not datas:
            return None
        return StepListing(
            step=step,
            committed_ranks=frozenset(manifests),
            partial_ranks=frozenset(datas - manifests),
            world_size=world_size,
            mtime=mtime or None,
            has_commit=has_commit,
        )

    def _read_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        path = self.manifest_path(job_id, step, rank)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ShardUnavailable(
                f"{path}: no manifest, rank {rank} of step {step} is not committed in the "
                f"{self.name} tier"
            ) from None
        except OSError as exc:
            raise ShardUnavailable(
                f"cannot read {path} ({exc.strerror}); check the mount and its permissions"
            ) from exc
        return parse_manifest(raw, str(path), job_id, step, rank)

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        """The committed manifest of the shard.

        Raises :class:`ShardUnavailable` (missing, unreadable, another job or format version:
        skipped, never quarantined) or :class:`ShardCorrupt` (malformed, or it names another
        step/rank than its path).
        """
        return self._read_manifest(job_id, step, rank)

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        """Check the committed data file against its manifest in place (no copy)."""
        manifest = self.get_manifest(job_id, step, rank)
        self.verify_file(self.data_path(job_id, step, rank), manifest)
        return manifest

    def verify_file(self, path: Path, manifest: Manifest) -> None:
        """Check the first ``data_nbytes`` of ``path`` against the manifest's CRC32Cs.

        Raises :class:`ShardCorrupt` naming the file and the first bad chunk, or when the file is
        shorter than the manifest records.
        """
        try:
            crcs, whole = crc.file_chunk_crcs(
                path, manifest.data_nbytes, manifest.chunk_size, threads=self.verify_threads
            )
        except FileNotFoundError:
            raise ShardCorrupt(f"{path}: data object missing under a committed manifest") from None
        except ValueError as exc:
            raise ShardCorrupt(f"{exc} (truncated); quarantine it") from None
        crc.check_shard_crcs(path, manifest, crcs, whole)

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        """Copy the shard's data into ``dst_path`` chunk by chunk, checking each chunk's CRC32C.

        ``dst_path`` is created if missing and NOT truncated (it may be a pre-faulted RAM slot
        longer than the data); bytes beyond ``data_nbytes`` are left as they were. Raises
        :class:`ShardUnavailable` (not committed, or not yet checksummed while ``verify``),
        :class:`ShardCorrupt` (truncated or a CRC32C mismatch: quarantine and fall back),
        :class:`TierFull` (the destination is full), :class:`TierError` otherwise.
        """
        m = self.get_manifest(job_id, step, rank)
        if verify and not m.verified:
            raise ShardUnavailable(
                f"{self.manifest_path(job_id, step, rank)} has no checksums yet (its writer "
                "stopped before the checksum pass); it cannot be verified"
            )
        src = self.data_path(job_id, step, rank)
        try:
            sfd = os.open(src, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardCorrupt(f"{src}: data object missing under a committed manifest") from None
        except OSError as exc:
            raise ShardUnavailable(f"cannot open {src} ({exc.strerror})") from exc
        try:
            size = os.fstat(sfd).st_size
            if size < m.data_nbytes:
                raise ShardCorrupt(
                    f"{src} holds {size} bytes, its manifest records {m.data_nbytes} "
                    "(truncated); quarantine it and restore from another tier"
                )
            copy_verified(sfd, src, Path(dst_path), m, verify)
        finally:
            os.close(sfd)
        return m

    # -- writing --------------------------------------------------------------------------------

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        """Commit a shard from ``src_path`` (its first ``manifest.data_nbytes`` bytes).

        The manifest must carry its checksums. With ``verify_source`` the source is checked
        against them while it is copied, in one pass (:class:`ShardCorrupt` when it does not
        match: what was written is removed, nothing is committed). The committed copy is then
        known to hold the checked bytes (:attr:`Tier.put_checks_written`).
        Returns data bytes written (0 when this exact shard is already committed here).
        Raises :class:`TierFull` on ENOSPC/EDQUOT and :class:`TierError` on other errors
        (including a failed fsync); in both cases the files this call wrote are removed and
        every committed step is untouched.
        """
        manifest.check_identity(job_id, step, rank, None)
        if not manifest.verified:
            raise TierError(
                f"refusing to commit rank {rank} of step {step} to the {self.name} tier: its "
                "manifest has no checksums yet (only checksummed shards are promoted)"
            )
        src = Path(src_path)
        d = self.step_dir(job_id, step)
        data = self.data_path(job_id, step, rank)
        man = self.manifest_path(job_id, step, rank)
        if self._already_committed(job_id, step, rank, manifest):
            if verify_source:
                self.verify_file(src, manifest)
            return 0
        written: list[Path] = []
        try:
            make_dirs(d, self._sync_dir)
            if man.exists():
                # A different copy of this shard is committed: un-commit it before its data is
                # replaced, so no reader ever pairs the old manifest with new bytes -- and only
                # once the new source is known good, so a bad source never costs the old copy
                # (a second read of the source, on this rare path only). The step's global
                # commit record named the old copy: it goes first.
                if verify_source:
                    self.verify_file(src, manifest)
                remove_quietly(d / layout.COMMIT_NAME)
                man.unlink()
                self._sync_dir(d)
            try:
                write_data(src, data, manifest, written, check=verify_source, fsync=self.fsync)
            except ShardCorrupt:
                for p in reversed(written):
                    remove_quietly(p)
                with contextlib.suppress(OSError):
                    d.rmdir()
                raise
            faults.point("posix.data_written")
            tmp = temp_name(man)
            self._write_file(tmp, manifest.to_json(), written)
            os.rename(tmp, man)
            written.remove(tmp)
            written.append(man)
            self._sync_dir(d)
        except OSError as exc:
            for p in reversed(written):
                remove_quietly(p)
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: other ranks' shards stay
            if exc.errno in FULL_ERRNOS:
                raise TierFull(
                    f"no space left on the {self.name} tier writing {exc.filename or data}; the "
                    "partial files were removed and the previous committed steps are intact; "
                    "free space, lower keep, or enlarge the volume"
                ) from exc
            raise TierError(
                f"writing rank {rank} of step {step} to {d} failed ({exc}); the attempt was "
                "abandoned (fsync is never retried) and its files removed; rewrite from the "
                "source tier"
            ) from exc
        return manifest.data_nbytes

    def _already_committed(self, job_id: str, step: int, rank: int, manifest: Manifest) -> bool:
        try:
            current = self._read_manifest(job_id, step, rank)
        except ShardUnavailable:
            return False
        if current.crc32c != manifest.crc32c or current.data_nbytes != manifest.data_nbytes:
            return False
        try:
            return self.data_path(job_id, step, rank).stat().st_size >= manifest.data_nbytes
        except FileNotFoundError:
            return False

    def _sync_dir(self, d: Path) -> None:
        if self.fsync:
            fsync_dir(d)

    def _write_file(self, path: Path, payload: bytes, written: list[Path]) -> None:
        if path.exists():  # a fresh temporary name: never someone else's file
            raise FileExistsError(errno.EEXIST, "temporary file exists", str(path))
        written.append(path)  # removed by the caller on any failure below
        write_new(path, payload, fsync=self.fsync)

    # -- removing -------------------------------------------------------------------------------

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        """Remove a step (all its files) or some ranks of it: manifests first, then data."""
        d = self.step_dir(job_id, step)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return
        shards = [(n, layout.parse_shard(n)) for n in names]
        manifests = [
            n for n, p in shards if p and p[1] == "manifest" and (ranks is None or p[0] in ranks)
        ]
        if manifests:  # the step is no longer complete: the global commit record goes first
            remove_quietly(d / layout.COMMIT_NAME)
            self._sync_dir(d)
        for n in manifests:
            remove_quietly(d / n)
        if manifests:
            self._sync_dir(d)
        for n, p in shards:
            if p is None:
                if ranks is None:
                    remove_quietly(d / n)
            elif p[1] == "data" and (ranks is None or p[0] in ranks):
                remove_quietly(d / n)
        if manifests:
            # A sidecar that read the manifests before they went may have created the record
            # since: it names shards that are gone now.
            remove_quietly(d / layout.COMMIT_NAME)
        try:
            d.rmdir()
            self._sync_dir(d.parent)
        except OSError:
            pass  # other ranks' files (or quarantined copies) remain

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        """Rename the shard's manifest and data to ``<name>.quarantined-<ts>`` (+ ``.reason``)."""
        ts = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
        man = self.manifest_path(job_id, step, rank)
        data = self.data_path(job_id, step, rank)
        try:
            os.rename(man, man.with_name(f"{man.name}{layout.QUARANTINE_SUFFIX}-{ts}"))
        except FileNotFoundError:
            return
        self._quarantine_data(data, ts)
        try:
            note = man.with_name(f"{layout.shard_stem(rank)}{layout.QUARANTINE_SUFFIX}-{ts}.reason")
            note.write_text(reason + "\n")
        except OSError:
            pass
        self._sync_dir(man.parent)
        log.warning(
            "quarantined rank %d of step %d in the %s tier (%s): %s",
            rank,
            step,
            self.name,
            self.root,
            reason,
        )

    def _quarantine_data(self, data: Path, ts: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.rename(data, data.with_name(f"{data.name}{layout.QUARANTINE_SUFFIX}-{ts}"))
