"""The one storage interface every tier implements (RAM, PVC, GCS): :class:`Tier` is the whole
contract the promotion engine and restore use; they never ask which concrete tier they hold.

Call order of a write (the commit protocol, docs/architecture.md "Commit protocol"):

1. ``put_shard(job, step, rank, src_path, manifest)``: the tier writes the data object from the
   local file ``src_path`` (first ``manifest.data_nbytes`` bytes), makes it durable, verifies it
   against ``manifest.crc32c`` where the medium reports one, then writes the manifest LAST.
   Returning is the commit point. On any error nothing is committed and the previous steps are
   untouched; a partially written data object may remain (garbage-collected later).
2. Readers list with ``list_steps``/``committed_ranks`` (manifest present = committed), read with
   ``get_manifest`` and ``fetch_shard`` (which verifies the CRC32C of what it copied), and
   ``quarantine`` a copy that fails verification so it is never served again.
3. Retention calls ``delete_step``: manifests first (un-commit), then data; garbage collection
   calls ``gc_incomplete`` for leftovers outside the layout (e.g. parts of an interrupted upload).

Optional abilities have defaults here, so a medium with nothing to do implements nothing:
``data_path`` (a local file of the data object: None), ``read_in_place`` (serve a shard where it
lies instead of copying it out: None), ``verify_shard`` (check a committed copy: fetch it into a
temporary file with verification), ``gc_incomplete`` (nothing to collect), ``close`` (nothing
to release).

Errors: every method raises a :class:`TierError` subclass whose message names the file/object and
says what to do; callers fall back to the next tier on :class:`ShardUnavailable`.
"""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.config import TierName
from strata.errors import ManifestError, ShardCorrupt, ShardUnavailable, TierError
from strata.format.manifest import FORMAT_VERSION, Manifest, ManifestVersionError


def parse_manifest(
    raw: bytes, where: str, job_id: str, step: int, rank: int, job_hint: str = ""
) -> Manifest:
    """Parse a stored manifest and check it is the shard asked for (every tier reads this way).

    The manifest's seal (its CRC32C trailer, :mod:`strata.format.sealed`) is verified on
    ``raw`` before any field is read. Raises :class:`ShardCorrupt` when it does not verify, is
    malformed or names another step or rank (quarantine it), and :class:`ShardUnavailable` for another format version or another job: those are not
    corruption, so the copy is skipped, never quarantined. ``job_hint``: where the job id comes
    from in this tier, appended to the "another job" message.
    """
    try:
        m = Manifest.from_json(raw, where)
    except ManifestVersionError as exc:
        raise ShardUnavailable(str(exc)) from None
    except ManifestError as exc:
        raise ShardCorrupt(f"{exc}; quarantine it and restore from another tier") from None
    if m.format_version != FORMAT_VERSION:
        raise ShardUnavailable(
            f"{where}: manifest format version {m.format_version}, this Strata reads "
            f"{FORMAT_VERSION}; upgrade Strata or restore another step"
        )
    if m.job_id != job_id:
        raise ShardUnavailable(
            f"{where}: manifest of job {m.job_id!r}, not {job_id!r}; check STRATA_JOB_ID / the "
            f"strata.dev/run-id annotation{job_hint}"
        )
    try:
        m.check_identity(job_id, step, rank, None)
    except ManifestError as exc:
        raise ShardCorrupt(f"{where}: {exc}; quarantine it") from None
    return m


@dataclass(frozen=True)
class InPlaceShard:
    """A shard served where it lies (:meth:`Tier.read_in_place`): its manifest, its data file,
    and notes on anything done to it (e.g. checksummed now because its writer had not)."""

    manifest: Manifest
    path: Path
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StepListing:
    """What a tier holds of one step: ranks with a manifest, and ranks with data but no manifest."""

    step: int
    committed_ranks: frozenset[int]
    partial_ranks: frozenset[int] = frozenset()
    world_size: int | None = None
    """From any committed manifest of the step (None if none is readable)."""
    mtime: float | None = None
    """Newest modification time seen in the step (seconds since the epoch), for GC grace."""
    has_commit: bool = False
    """A global commit record (``commit.json``) is present; whether it verifies and matches
    the shards is for :mod:`strata.tiers.records` to say."""

    @property
    def complete(self) -> bool:
        return self.world_size is not None and len(self.committed_ranks) >= self.world_size


class Tier(abc.ABC):
    """A place that holds checkpoints in the common layout (:mod:`strata.format.layout`)."""

    name: TierName

    put_checks_written: bool = False
    """True when :meth:`put_shard` (with ``verify_source``), having written bytes (returned
    > 0), has itself established that the committed data object holds exactly the bytes its
    manifest describes (the POSIX tiers checksum the very bytes they write; GCS compares the
    server's CRC32C of the stored object). The promotion engine then skips its read-back
    verification of the copy. False (the default): the engine verifies every copy."""

    @abc.abstractmethod
    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        """Every step of ``job_id`` with at least one data object or manifest, by step."""

    @abc.abstractmethod
    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        """The committed manifest; :class:`ShardUnavailable` if absent, ShardCorrupt if malformed."""

    @abc.abstractmethod
    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        """Commit a shard from a local file (see the module docstring); returns bytes written.

        ``verify_source``: check the source against the manifest's checksums before writing
        (:class:`ShardCorrupt`, nothing written); a tier that verifies what it stored against
        the manifest anyway (GCS compares the server's CRC32C) may always check.
        """

    @abc.abstractmethod
    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        """Copy the data object into local ``dst_path`` (created/overwritten) and return its manifest.

        With ``verify`` the copied bytes are checked against the manifest's CRC32C; a mismatch
        raises :class:`ShardCorrupt` (the caller quarantines and falls back).
        """

    @abc.abstractmethod
    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        """Remove a step (or some ranks of it): manifests first, then data."""

    @abc.abstractmethod
    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        """Un-commit a bad copy without destroying it (renamed aside), so it is never served again."""

    # -- optional abilities, with defaults -------------------------------------------------------

    def data_path(self, job_id: str, step: int, rank: int) -> Path | None:
        """The local file holding the shard's data object, when this process can read the
        medium as files (RAM, PVC); None for a medium it cannot (object stores; the default).
        Says nothing about whether the shard is committed (use :meth:`get_manifest`)."""
        return None

    def local_root(self) -> Path | None:
        """The local directory this tier lives in, when the medium is a file system this
        process mounts (RAM, PVC: what ``statvfs`` measures); None for an object store (the
        default)."""
        return None

    def list_jobs(self) -> list[str]:
        """Job ids that have steps in this tier (a ``<job>/steps/`` directory or prefix),
        sorted. :class:`TierError` when the tier cannot be listed. Default: none (a tier that
        holds one job's copies only, such as the peer tier)."""
        return []

    def read_in_place(
        self, job_id: str, step: int, rank: int, *, world_size: int | None, verify: bool
    ) -> InPlaceShard | None:
        """Serve a committed shard where it lies instead of copying it out (the RAM tier: the
        trainer loads its own node's tmpfs file). None (the default): copy it with
        :meth:`fetch_shard`. ``world_size``: refuse a shard of another world size
        (:class:`ShardUnavailable`); ``verify``: check it against its manifest first
        (:class:`ShardCorrupt`)."""
        return None

    def read_range(self, job_id: str, step: int, rank: int, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes of the committed data object from byte ``offset``, as stored (an
        incremental copy's stored object, not its logical one), NOT verified: the caller checks
        them against the manifest's chunk CRC32Cs (:func:`strata.tiers.references.read_logical`).

        Fewer bytes only when the object ends first (the caller calls that truncated). Raises
        :class:`ShardUnavailable` when there is no data object, another :class:`TierError` when
        the medium fails. Default: ``pread`` of :meth:`data_path`; a tier without local files
        and no override fetches the whole shard (verified) into a local temporary file ONCE
        and reads every later range of that shard from it, until :meth:`drop_fetched` (a
        resharding reader calls it when it closes; an object that nothing references any more
        is removed when collected). That costs local disk the size of every shard so read.
        """
        path = self.data_path(job_id, step, rank)
        if path is None:
            path = self._fetched(job_id, step, rank)
        return _pread_file(path, offset, nbytes)

    def _fetched(self, job_id: str, step: int, rank: int) -> Path:
        """A local, verified copy of the shard's data object (fetched on first use)."""
        cache: dict[tuple[str, int, int], tuple[Path, Any]]  # (data file, its weakref.finalize)
        cache = self.__dict__.setdefault("_fetched_copies", {})
        key = (job_id, step, rank)
        held = cache.get(key)
        if held is not None and held[1].alive:
            return held[0]
        tmp = Path(tempfile.mkdtemp(prefix="strata-range-"))
        # Removed by drop_fetched, else when this tier is collected or the process exits.
        gone = weakref.finalize(self, shutil.rmtree, tmp, ignore_errors=True)
        try:
            self.fetch_shard(job_id, step, rank, tmp / "data", verify=True)
        except BaseException:
            gone()
            raise
        cache[key] = (tmp / "data", gone)
        return tmp / "data"

    def drop_fetched(self) -> None:
        """Remove the local copies the default :meth:`read_range` fetched (none: nothing)."""
        cache = self.__dict__.pop("_fetched_copies", {})
        for _path, gone in cache.values():
            gone()

    def verify_shard(self, job_id: str, step: int, rank: int) -> Manifest:
        """Check the committed copy against its manifest (length, CRC32C) and return the
        manifest. Raises :class:`ShardUnavailable` (not committed) or :class:`ShardCorrupt`.

        Default: fetch it into a temporary file with verification; a tier that can check in
        place (a local file, a server-side checksum) overrides this.
        """
        with tempfile.TemporaryDirectory(prefix="strata-verify-") as tmp:
            return self.fetch_shard(job_id, step, rank, Path(tmp) / "data", verify=True)

    def gc_incomplete(self, job_id: str, grace_seconds: float) -> list[str]:
        """Delete this writer's uncommitted leftovers outside the layout's steps that the
        listing cannot show (e.g. parts of an interrupted upload) once older than
        ``grace_seconds``; returns what was deleted. Default: nothing to collect."""
        return []

    def close(self) -> None:
        """Release connections or other resources (default: none)."""
        return None

    # -- small records (commit.json, incarnation records; strata.tiers.records) ----------------

    def read_record(self, key: str) -> bytes | None:
        """The bytes of the small object at layout ``key``; None when absent.
        :class:`TierError` when the tier cannot be read. Default: this tier keeps no records."""
        return None

    def create_record(self, key: str, payload: bytes) -> bool:
        """Create the small object at ``key`` only if absent (durably, atomically: a reader
        sees all of ``payload`` or nothing); True when created, False when something is already
        there (the caller reads and compares). :class:`TierError`/:class:`TierFull` on failure,
        nothing left behind. Default: :class:`TierError` (this tier keeps no records)."""
        raise TierError(f"the {self.name} tier keeps no records (cannot write {key})")

    def delete_record(self, key: str) -> None:
        """Remove the small object at ``key`` (absent: nothing to do). Default: nothing."""
        return None

    def list_records(self, prefix: str) -> list[str]:
        """Names (last path component) of the objects directly under layout ``prefix``."""
        return []

    # -- scoped reads (a sidecar's cost per step independent of the world size) ---------------

    def step_numbers(self, job_id: str) -> list[int]:
        """The steps of ``job_id`` that hold any object, ascending, without looking inside them
        (GCS: one delimiter listing, a page per 1,000 steps; POSIX: one directory read).
        Default: the keys of :meth:`list_steps`. :class:`TierError` when it cannot be listed."""
        return sorted(self.list_steps(job_id))

    def list_step(self, job_id: str, step: int) -> StepListing | None:
        """What the tier holds of one step (None: nothing), listing that step alone (its W
        ranks' objects, not the whole job's). Default: from :meth:`list_steps`."""
        return self.list_steps(job_id).get(step)

    def complete_steps(self, job_id: str) -> list[int]:
        """Steps whose every rank is committed here, ascending."""
        return sorted(s for s, listing in self.list_steps(job_id).items() if listing.complete)

    def newest_complete_step(self, job_id: str) -> int | None:
        steps = self.complete_steps(job_id)
        return steps[-1] if steps else None


def _pread_file(path: Path, offset: int, nbytes: int) -> bytes:
    """Bytes ``[offset, offset + nbytes)`` of ``path`` (fewer at its end); ShardUnavailable
    when it is missing, TierError when the read fails."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ShardUnavailable(f"{path} does not exist (not committed here)") from None
    except OSError as exc:
        raise TierError(f"cannot open {path} ({exc.strerror}); check the mount") from exc
    try:
        parts = []
        done = 0
        while done < nbytes:
            piece = os.pread(fd, nbytes - done, offset + done)
            if not piece:
                break
            parts.append(piece)
            done += len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    except OSError as exc:
        raise TierError(f"reading {path} at byte {offset} failed ({exc.strerror})") from exc
    finally:
        os.close(fd)
