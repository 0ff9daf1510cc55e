"""Committing a copied RAM slot: :class:`SlotCommit` (the manifest, the commit, the confirmation).

A save copies the state's bytes into a slot it holds the write lock of; committing it in the
RAM tier (:meth:`strata.tiers.ram.RamTier.commit_slot`, checked to be the inode written) makes
the step visible. Two ways:

- :meth:`SlotCommit.commit`: a manifest *without* checksums; the background checksum pass
  (:mod:`strata.client.background`) adds them.
- :meth:`SlotCommit.confirm_and_commit`: a save that left some storages' bytes in place
  (:mod:`strata.client.reuse`) is committed, with its checksums, only once those bytes are
  confirmed by CRC32C against the live ones; a mismatch makes the step a failed save.

Every manifest carries the writer id, the incarnation the last restore opened and, for states
with slow components (:mod:`strata.client.cadence`), the step each one's bytes come from.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

from strata import faults
from strata.client.background import Checksum, ChecksumPass
from strata.client.reuse import SlotReuse
from strata.client.unchanged import Signature, Snapshot, storage_signatures
from strata.format import codec
from strata.format.manifest import DEFAULT_CHUNK_SIZE, Manifest
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotWriteLock


@dataclass
class CopiedSlot:
    """One save's bytes of ``step`` in a slot it holds the write ``lock`` of, to commit."""

    step: int
    enc: codec.EncodedState
    lock: SlotWriteLock
    versions: list[int]
    """The version counters of ``enc.live`` as of the bytes copied ("unchanged since" hint)."""
    skip: frozenset[int] = frozenset()
    """Storages left in place: the slot already held their live bytes (:mod:`.reuse`)."""
    addr: int = 0
    """Address of the slot's mapping, once copied (confirmation reads the bytes there)."""
    sigs: list[Signature | None] | None = None
    """The storages' signatures as read when copying (None: read at confirmation)."""

    @property
    def copied_nbytes(self) -> int:
        """Bytes written into the slot (all but the storages left in place)."""
        return self.enc.data_nbytes - sum(self.enc.storages[i].nbytes for i in self.skip)


class SlotCommit:
    """Commits of rank ``rank`` of ``world_size`` of ``job_id`` into ``ram``; ``reuse``: what
    each slot holds; ``checksums``: the "unchanged since" hint it keeps; ``copy_pool`` /
    ``copy_threads``: the threads confirming bytes left in place."""

    def __init__(
        self,
        ram: RamTier,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        writer_id: str,
        reuse: SlotReuse,
        checksums: ChecksumPass,
        copy_pool: Executor,
        copy_threads: int,
    ) -> None:
        self.ram = ram
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.writer_id = writer_id
        self.reuse = reuse
        self.checksums = checksums
        self.copy_pool = copy_pool
        self.copy_threads = copy_threads
        self.chunk_size = DEFAULT_CHUNK_SIZE
        self.incarnation = ""
        """Stamped into every manifest (``""``: no restore opened one yet)."""
        self.component_steps: dict[int, dict[str, int]] = {}
        """Step -> its slow components' steps, until that step's manifest is written."""

    def manifest(self, step: int, enc: codec.EncodedState) -> Manifest:
        """``step``'s manifest for ``enc`` (without checksums)."""
        manifest = enc.manifest(
            job_id=self.job_id,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            writer_id=self.writer_id,
            chunk_size=self.chunk_size,
        ).model_copy(update={"incarnation": self.incarnation})
        slow = self.component_steps.pop(step, None)
        if slow:
            manifest = manifest.model_copy(update={"component_steps": slow})
        return manifest

    def commit(self, slot: CopiedSlot) -> Checksum:
        """Commit ``slot`` (checked to be the inode written) with a manifest without
        checksums. Returns the checksum pass for the caller to start
        (:meth:`ChecksumPass.start`). Raises what the RAM tier raises."""
        faults.point("save.copied")
        step, enc, lock = slot.step, slot.enc, slot.lock
        manifest = self.manifest(step, enc)
        self.ram.commit_slot(
            self.job_id, step, self.rank, lock.path, manifest, expect=lock.identity
        )
        snap = Snapshot(list(enc.live), slot.versions, list(enc.sources))
        return (step, manifest.created.isoformat(), snap, lock.identity, enc.storages)

    def confirm_and_commit(self, slot: CopiedSlot) -> None:
        """Commit ``slot``, which left ``slot.skip`` in place, once the slot's bytes are
        confirmed to be the live ones (:func:`strata.client.reuse.confirm`); releases its lock.
        Raises on a mismatch (skipping is then off for those storages)."""
        step, enc, lock = slot.step, slot.enc, slot.lock
        try:
            sigs = slot.sigs
            if sigs is None:
                sigs = storage_signatures(enc.live, slot.versions, enc.sources)
            snap = Snapshot(list(enc.live), slot.versions, list(enc.sources))
            unchanged = self.checksums.unchanged.since(step, snap, sigs)
            faults.point("save.confirm")
            res = self.reuse.confirmed(
                step,
                enc,
                slot.addr,
                slot.skip,
                sigs,
                self.chunk_size,
                self.copy_pool,
                self.copy_threads,
            )
            manifest = self.manifest(step, enc).model_copy(
                update={
                    "chunk_crc32c": res.chunk_crc32c,
                    "crc32c": res.crc32c,
                    "unchanged_since": unchanged,
                    "sub_crc32c": res.sub_crc32c,
                }
            )
            self.ram.commit_slot(
                self.job_id, step, self.rank, lock.path, manifest, expect=lock.identity
            )
            self.reuse.remember(lock.identity, step, enc.storages, sigs, enc.sources)
        finally:
            lock.release()
