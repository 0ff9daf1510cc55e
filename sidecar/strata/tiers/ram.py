"""The RAM tier: a tmpfs directory holding a ring of pre-faulted slot files per rank.

Why (docs/architecture.md "RAM tier and the training stall"): writing fresh tmpfs files faults in every
4 KiB page on first touch (~1 GB/s per core, 8-15x a memcpy). So each rank owns at least
``keep + 1`` *slot* files, allocated once (``posix_fallocate``) and mapped persistently with
``MAP_POPULATE`` by the writer; ``save()`` is then a memcpy into a mapped slot.

Layout under the RAM root::

    <job>/slots/rank-RRRRR/slot-K                  pre-allocated slot files (K = 0, 1, ...)
    <job>/steps/<step>/rank-RRRRR.data             HARD LINK to the slot holding that step
    <job>/steps/<step>/rank-RRRRR.manifest         commit record (``data_nbytes`` <= slot size)

A slot is *free* when no step links to it (link count 1). Committing a step into a slot
(:meth:`RamTier.commit_slot`) links it as the step's data and writes the manifest last.
Reusing a slot un-commits its old step first (manifest removed, then the link) and only while
holding ``fcntl.flock(LOCK_EX | LOCK_NB)`` on it. Readers (the sidecar promoting to the PVC, the
client's checksum pass, a restore) hold ``LOCK_SH`` through :class:`SlotLease` while they read, so
a slot under promotion is never overwritten (C-05): the writer takes another free slot or grows
the ring by one slot instead -- never a torn copy.

Slot allocation sits behind the :class:`SlotProvider` protocol. :class:`LocalSlotProvider`
allocates in-process; the sidecar offers a socket-backed provider that allocates and pre-faults
the slots itself, so their tmpfs pages are charged to the sidecar container (whose memory limit
the webhook sizes to the RAM tier).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from pathlib import Path

from strata import faults
from strata.errors import ShardUnavailable, TierError, TierFull
from strata.format import crc, layout
from strata.format.manifest import Manifest, SubChunkCrcs
from strata.tiers.base import InPlaceShard
from strata.tiers.posix import PosixTier
from strata.tiers.posix_io import copy_range, remove_quietly
from strata.tiers.slots import (
    Identity,
    LocalSlotProvider,
    SlotLease,
    SlotState,
    SlotWriteLock,
    path_identity,
    slot_ranks_in,
    slots_dir,
)

log = logging.getLogger(__name__)


class RamTier(PosixTier):
    """The RAM tier on a tmpfs directory (see the module docstring).

    Reading, listing, retention and quarantine are the POSIX tier's; writes go through slots:
    :meth:`commit_slot` (the training client), :meth:`put_shard` (copy a file into a slot).
    fsync is off: on tmpfs it is a no-op, and RAM-tier durability is the pod's lifetime.
    """

    put_checks_written = False  # put_shard checks the source, then copies in the kernel

    def __init__(
        self, root: str | os.PathLike[str], *, keep: int = 1, verify_threads: int = 1
    ) -> None:
        super().__init__(root, "ram", fsync=False, verify_threads=verify_threads)
        self.keep = keep

    def slots_dir(self, job_id: str, rank: int) -> Path:
        return slots_dir(self.root, job_id, rank)

    def slot_ranks(self, job_id: str) -> list[int]:
        """Ranks that have a slot ring in this job's RAM directory, ascending."""
        return sorted(slot_ranks_in(self.root, job_id))

    def slot_sizes(self, job_id: str) -> dict[int, list[int]]:
        """Per rank with a slot ring, the sizes of its slot files in bytes (directory order)."""
        out: dict[int, list[int]] = {}
        for rank, d in slot_ranks_in(self.root, job_id).items():
            try:
                out[rank] = [e.stat().st_size for e in os.scandir(d)]
            except FileNotFoundError:
                continue
        return out

    def slot_states(self, job_id: str, rank: int) -> list[SlotState]:
        """Every slot of the rank with the steps that link to it (by inode)."""
        d = self.slots_dir(job_id, rank)
        slots: dict[int, SlotState] = {}
        try:
            entries = list(os.scandir(d))
        except FileNotFoundError:
            return []
        for e in entries:
            if layout.parse_slot(e.name) is not None:
                st = e.stat()
                slots[st.st_ino] = SlotState(Path(e.path), st.st_size, [])
        steps_dir = self.root / layout.steps_prefix(job_id)
        stem = layout.shard_stem(rank)
        try:
            step_entries = list(os.scandir(steps_dir))
        except FileNotFoundError:
            step_entries = []
        for se in step_entries:
            step = layout.parse_step(se.name)
            if step is None:
                continue
            try:
                ino = os.stat(os.path.join(se.path, stem + layout.DATA_SUFFIX)).st_ino
            except FileNotFoundError:
                continue
            if ino in slots:
                committed = os.path.exists(os.path.join(se.path, stem + layout.MANIFEST_SUFFIX))
                slots[ino].steps.append((step, committed))
        return sorted(slots.values(), key=lambda s: s.path.name)

    def uncommit(self, job_id: str, step: int, rank: int) -> None:
        """Remove a rank's shard of a step: manifest first, then the data link; drop empty dirs.

        Also removes that shard's leftover temporary manifests (a writer killed mid-rename).
        """
        man = self.manifest_path(job_id, step, rank)
        remove_quietly(man)
        remove_quietly(self.data_path(job_id, step, rank))
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(man.parent):
                if name.startswith(man.name + ".tmp-"):
                    remove_quietly(man.parent / name)
        with contextlib.suppress(OSError):
            self.step_dir(job_id, step).rmdir()

    def commit_slot(
        self,
        job_id: str,
        step: int,
        rank: int,
        slot: Path,
        manifest: Manifest,
        expect: Identity | None = None,
    ) -> None:
        """Commit ``slot`` (already holding the data) as rank ``rank``'s shard of ``step``.

        Links the slot as ``rank-R.data`` (replacing a stale partial link, and un-committing a
        previous copy of the same shard first), then writes the manifest under a temporary name
        and renames it: the commit point. The caller holds ``LOCK_EX`` on the slot; ``expect``
        is the ``(st_dev, st_ino)`` of the inode it wrote (:attr:`SlotWriteLock.identity`).
        The data link is checked to be that inode before the manifest is written and again
        after it; when it is not (the slot was replaced, or the link removed under us), the
        shard is un-committed and :class:`TierError` raised, so a save never reports a commit
        whose data is not the bytes it wrote.
        """
        manifest.check_identity(job_id, step, rank, None)
        d = self.step_dir(job_id, step)
        d.mkdir(parents=True, exist_ok=True)
        data = self.data_path(job_id, step, rank)
        man = self.manifest_path(job_id, step, rank)
        remove_quietly(man)
        want = expect if expect is not None else path_identity(slot)
        if want is None or path_identity(slot) != want:
            raise TierError(
                f"RAM slot {slot} is no longer the file that was written; this save is skipped "
                "(the previous committed step is intact)"
            )
        if path_identity(data) != want:
            remove_quietly(data)
            os.link(slot, data)
        if path_identity(data) != want:
            self.uncommit(job_id, step, rank)
            raise TierError(f"{data}: linked to another file than RAM slot {slot}; save skipped")
        faults.point("commit.linked")
        self.write_manifest(job_id, step, rank, manifest)
        if path_identity(data) != want:
            self.uncommit(job_id, step, rank)
            raise TierError(
                f"{data}: removed or replaced while rank {rank} of step {step} was being "
                "committed (a sidecar restarting and pruning?); the step was un-committed and "
                "this save is skipped"
            )
        faults.point("commit.done")

    def write_manifest(self, job_id: str, step: int, rank: int, manifest: Manifest) -> None:
        """Atomically (temp name + rename) write the shard's manifest."""
        man = self.manifest_path(job_id, step, rank)
        tmp = man.with_name(f"{man.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_bytes(manifest.to_json())
            os.rename(tmp, man)
        except OSError as exc:
            remove_quietly(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"no space left on the RAM tier writing {man}") from exc
            raise

    def update_checksums(
        self,
        job_id: str,
        step: int,
        rank: int,
        chunk_crc32c: list[int],
        crc32c: int,
        unchanged_since: list[int] | None = None,
        sub_crc32c: SubChunkCrcs | None = None,
    ) -> Manifest | None:
        """Record checksums in a committed, not yet checksummed manifest (caller holds a lease);
        ``sub_crc32c``: also the sub-chunk CRCs computed with them (None: none recorded).

        Returns the manifest as now committed, or None (changing nothing) when the shard is no
        longer committed or already has checksums.
        """
        try:
            current = self.get_manifest(job_id, step, rank)
        except ShardUnavailable:
            return None
        if current.verified:
            return None
        update: dict[str, object] = {"chunk_crc32c": chunk_crc32c, "crc32c": crc32c}
        if unchanged_since is not None:
            update["unchanged_since"] = unchanged_since
        if sub_crc32c is not None:
            update["sub_crc32c"] = sub_crc32c
        updated = current.model_copy(update=update)
        self.write_manifest(job_id, step, rank, updated)
        return updated

    def seal(self, lease: SlotLease, unchanged_since: list[int] | None = None) -> Manifest | None:
        """Checksum a leased committed shard whose manifest has no checksums yet and record them
        (:meth:`update_checksums`), with the trainer's ``unchanged_since`` hint per storage when
        given. Returns the manifest as now committed, or None when the shard was un-committed or
        checksummed by someone else meanwhile."""
        m = lease.manifest
        if m is None:
            return None
        sub = crc.sub_chunk_size(m.chunk_size)
        subs: SubChunkCrcs | None = None
        if sub is None:
            crcs, whole = crc.file_chunk_crcs(lease.path, m.data_nbytes, m.chunk_size)
        else:
            crcs, whole, pieces = crc.file_chunk_and_sub_crcs(
                lease.path, m.data_nbytes, m.chunk_size, sub
            )
            subs = SubChunkCrcs.of(pieces, sub)
        faults.point("seal.before")
        return self.update_checksums(
            lease.job_id, lease.step, lease.rank, crcs, whole, unchanged_since, subs
        )

    def read_in_place(
        self, job_id: str, step: int, rank: int, *, world_size: int | None, verify: bool
    ) -> InPlaceShard:
        """A RAM hit: the trainer loads the tmpfs file itself. Under a :class:`SlotLease` the
        shard is checked for ``world_size`` and verified against its manifest; a shard whose
        writer stopped before its checksum pass is checksummed now (and said so in ``notes``).
        Raises :class:`ShardUnavailable` (not committed, another world size) or
        :class:`ShardCorrupt`."""
        notes: list[str] = []
        with SlotLease(self, job_id, step, rank) as lease:
            m = lease.manifest
            assert m is not None
            if world_size is not None and m.world_size != world_size:
                raise ShardUnavailable(
                    f"{self.name}: step {m.step} rank {m.rank} was written with world size "
                    f"{m.world_size}, this job runs with {world_size}"
                )
            if verify and m.verified:
                self.verify_file(lease.path, m)
            elif verify:
                sealed = self.seal(lease)
                m = sealed if sealed is not None else self.get_manifest(job_id, step, rank)
                notes.append(
                    f"ram: step {step} rank {rank} had no checksums yet (its writer stopped "
                    "before the checksum pass); checksummed now, not verified against an "
                    "earlier record"
                )
            return InPlaceShard(m, lease.path, notes)

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        """Commit a shard from a file: copy it into a slot of this tier, then :meth:`commit_slot`."""
        src = Path(src_path)
        if verify_source and manifest.verified:
            self.verify_file(src, manifest)
        provider = LocalSlotProvider(self, keep=self.keep)
        lock = SlotWriteLock.acquire(provider, job_id, rank, manifest.data_nbytes)
        with lock as slot:
            sfd = os.open(src, os.O_RDONLY)
            dfd = os.open(slot, os.O_WRONLY)
            try:
                copy_range(sfd, dfd, manifest.data_nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise TierFull(f"no space left on the RAM tier writing {slot}") from exc
                raise TierError(f"copying {src} into RAM slot {slot} failed: {exc}") from exc
            finally:
                os.close(sfd)
                os.close(dfd)
            self.commit_slot(job_id, step, rank, slot, manifest, expect=lock.identity)
        return manifest.data_nbytes

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        """Rename the manifest aside and drop the data link, which frees the slot for reuse.

        A RAM slot is reused, so its bad bytes are not kept (the quarantined manifest and its
        ``.reason`` note stay as the record).
        """
        super().quarantine(job_id, step, rank, reason)

    def _quarantine_data(self, data: Path, ts: str) -> None:
        remove_quietly(data)
