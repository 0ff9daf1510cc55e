"""The one storage interface every tier implements (RAM, PVC, GCS).

Call order of a write (the commit protocol of DESIGN.md):

1. ``put_shard(job, step, rank, src_path, manifest)``: the tier writes the data object from the
   local file ``src_path`` (first ``manifest.data_nbytes`` bytes), makes it durable, verifies it
   against ``manifest.crc32c`` where the medium reports one, then writes the manifest LAST.
   Returning is the commit point. On any error nothing is committed and the previous steps are
   untouched; a partially written data object may remain (garbage-collected later).
2. Readers list with ``list_steps``/``committed_ranks`` (manifest present = committed), read with
   ``get_manifest`` and ``fetch_shard`` (which verifies the CRC32C of what it copied), and
   ``quarantine`` a copy that fails verification so it is never served again.
3. Retention calls ``delete_step``: manifests first (un-commit), then data.

Errors: every method raises a :class:`TierError` subclass whose message names the file/object and
says what to do; callers fall back to the next tier on :class:`ShardUnavailable`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

from strata.config import TierName
from strata.manifest import FORMAT_VERSION, Manifest, ManifestError


class TierError(RuntimeError):
    """A tier operation failed; the message names the object and what to do."""


class ShardUnavailable(TierError):
    """The shard is not committed in this tier (missing, partial, or quarantined)."""


class ShardCorrupt(ShardUnavailable):
    """A committed shard failed verification (checksum, length, manifest identity)."""


class TierFull(TierError):
    """No space left (ENOSPC / quota); the previous committed step is untouched."""


def parse_manifest(
    raw: bytes, where: str, job_id: str, step: int, rank: int, job_hint: str = ""
) -> Manifest:
    """Parse a stored manifest and check it is the shard asked for (every tier reads this way).

    Raises :class:`ShardCorrupt` when it is malformed or names another step or rank (quarantine
    it), and :class:`ShardUnavailable` for another format version or another job: those are not
    corruption, so the copy is skipped, never quarantined. ``job_hint``: where the job id comes
    from in this tier, appended to the "another job" message.
    """
    try:
        m = Manifest.from_json(raw, where)
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
class StepListing:
    """What a tier holds of one step: ranks with a manifest, and ranks with data but no manifest."""

    step: int
    committed_ranks: frozenset[int]
    partial_ranks: frozenset[int] = frozenset()
    world_size: int | None = None
    """From any committed manifest of the step (None if none is readable)."""
    mtime: float | None = None
    """Newest modification time seen in the step (seconds since the epoch), for GC grace."""

    @property
    def complete(self) -> bool:
        return self.world_size is not None and len(self.committed_ranks) >= self.world_size


class Tier(abc.ABC):
    """A place that holds checkpoints in the common layout (:mod:`strata.layout`)."""

    name: TierName

    @abc.abstractmethod
    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        """Every step of ``job_id`` with at least one data object or manifest, by step."""

    @abc.abstractmethod
    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        """The committed manifest; :class:`ShardUnavailable` if absent, ShardCorrupt if malformed."""

    @abc.abstractmethod
    def put_shard(
        self, job_id: str, step: int, rank: int, src_path: Path, manifest: Manifest
    ) -> int:
        """Commit a shard from a local file (see the module docstring); returns bytes written."""

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

    def complete_steps(self, job_id: str) -> list[int]:
        """Steps whose every rank is committed here, ascending."""
        return sorted(s for s, listing in self.list_steps(job_id).items() if listing.complete)

    def newest_complete_step(self, job_id: str) -> int | None:
        steps = self.complete_steps(job_id)
        return steps[-1] if steps else None
