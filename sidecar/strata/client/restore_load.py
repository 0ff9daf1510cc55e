"""Loading one rank's share of a restore: the tiers it reads, its staged RAM shard, the sharded
tensors it owns, and the slices of a step written at another world size.

Nothing here is collective (:mod:`strata.client.collectives` holds the protocol): each call
does this rank's work and returns or raises; the :class:`strata.client.restorer.Restorer`
carries the outcome into the next phase.

- :class:`RestoreTiers`: the tiers a restore reads, nearest first, built once (a GCS tier that
  cannot be built is left out with a note, never an error).
- :class:`RankLoader`: :meth:`~RankLoader.load_staged` (the staged RAM shard, in place, one
  pass: verified while copying when the stager left a RAM hit unverified),
  :meth:`~RankLoader.fill_pending` (sharded slices from the tiers),
  :meth:`~RankLoader.check_resharded` and :meth:`~RankLoader.read_resharded` (a step of
  another world size: its per-rank values first, then the load).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from strata.client.loader import load_shard
from strata.client.sharded import ShardedLoad, ShardReader
from strata.config import StrataConfig
from strata.errors import TierError
from strata.format import codec
from strata.format.manifest import Manifest
from strata.restore.reshard import PerRankValues, per_rank_values
from strata.tiers.base import Tier
from strata.tiers.configured import durable_tiers, in_restore_order
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotLease

log = logging.getLogger("strata.client")


class RestoreTiers:
    """The tiers a restore of ``config``'s job reads, in restore order (RAM first), built on
    the first call of :meth:`get` (``writer_id`` stamped on what they write). ``notes``: why a
    tier was left out (a GCS tier without credentials or client library, a peer tier the
    sidecar could not be asked about). ``peer``: builds the peer source on that first call,
    given a callback for such a note (:func:`strata.client.peer_source.peer_source`, None when
    there is none: the peers are reached through a sidecar only); :meth:`listing_notes` gives
    what it said about the peers when last listed."""

    def __init__(
        self,
        config: StrataConfig,
        ram: RamTier,
        writer_id: str,
        peer: Callable[[Callable[[str], None]], Tier | None] | None = None,
    ) -> None:
        self.config = config
        self.ram = ram
        self.writer_id = writer_id
        self.peer = peer
        self.notes: list[str] = []
        self._tiers: list[Tier] | None = None
        self._peer: Tier | None = None

    def get(self) -> list[Tier]:
        if self._tiers is None:

            def leave_out_gcs(exc: Exception) -> None:
                # No credentials or no client library must not stop a restore that RAM or the
                # PVC can serve: the tier is left out and the restore says so.
                note = f"gcs: not searched: {exc}"
                log.warning("strata: %s", note)
                self.notes.append(note)

            durable = durable_tiers(
                self.config, writer_id=self.writer_id, on_gcs_error=leave_out_gcs
            )
            self._peer = self.peer(self.notes.append) if self.peer is not None else None
            self._tiers = in_restore_order(self.config, self.ram, durable, self._peer)
        return self._tiers

    def listing_notes(self) -> list[str]:
        """What the peer source's last listing said (peers unreachable, ranks beyond the
        parity's tolerance: :attr:`strata.client.peer_source.PeerSource.notes`); [] without
        one or before it was listed."""
        return list(getattr(self._peer, "notes", ()))


class SlotBuffers(Protocol):
    """What a load borrows from the save path (:class:`strata.client.saver.Saver`): its copy
    threads and its mappings of the RAM slots (a restore reads them without page faults)."""

    @property
    def copy_pool(self) -> Executor: ...

    @property
    def copy_threads(self) -> int: ...

    def mapping_of(self, data_path: Path) -> mmap.mmap | None: ...

    def host_view(self, data_path: Path) -> torch.Tensor | None: ...


@dataclass
class LoadedShard:
    """This rank's staged shard, loaded in place (:meth:`RankLoader.load_staged`)."""

    tree: Any
    """The loaded state tree (live objects where they were updated in place)."""
    sharded: ShardedLoad
    """Its sharded tensors still to come from their owners or the tiers."""
    component_steps: dict[str, int]
    """Components saved at their own cadence -> the step their bytes come from."""
    slots_hint: tuple[int, bool] | None
    """(data bytes, holds CUDA tensors): what the next save's slots need; None: unknown (a
    sharded state is sized by encoding it)."""


@dataclass(frozen=True)
class DirectShard:
    """A copy of this rank's shard that a durable tier holds as a local file, to be loaded
    where it lies (:meth:`RankLoader.direct_source`)."""

    tier: Tier
    path: Path
    """Its data file."""
    manifest: Manifest


@dataclass
class ReshardRead:
    """This rank's read of a step written at another world size (:meth:`RankLoader.read_resharded`)."""

    tree: Any
    source_rank: int
    """The saved rank whose per-rank values this rank took."""
    parent: str
    """The incarnation that wrote the step ("" when unknown)."""
    nbytes: int
    """Bytes read from the tiers (whole checksum chunks)."""
    nbytes_needed: int
    """Bytes this rank needed: its per-rank values and its slices of the sharded tensors."""
    error: str | None
    """Why this rank could not load it (None: loaded)."""
    tiers: list[str]
    """The tiers that served the step's manifests to this rank, nearest first."""


@dataclass
class ReshardCheck:
    """The manifests of a step of another world size, read before loading
    (:meth:`RankLoader.check_resharded`)."""

    reader: ShardReader
    source_rank: int
    """The saved rank whose per-rank values this rank takes (the documented rule)."""
    saved_world: int
    values: PerRankValues
    """The step's per-rank values (empty when ``error``)."""
    error: str | None
    """Why this rank could not read the manifests (None: read)."""

    def close(self, notes: list[str]) -> None:
        """Close the reader, adding its notes to ``notes`` (each once)."""
        notes.extend(n for n in self.reader.notes if n not in notes)
        self.reader.close()


class RankLoader:
    """Loads for rank ``rank`` of ``world_size`` of ``job_id``: from ``ram`` (staged shards),
    with ``buffers`` (the save path's copy threads and slot mappings), reading the ``tiers``
    for sharded slices. ``verify``: the policy's ``restore.verify``. ``stager_deferred()``:
    whether the last staging left a RAM hit unverified (the load then verifies it)."""

    def __init__(
        self,
        ram: RamTier,
        job_id: str,
        rank: int,
        world_size: int,
        *,
        verify: bool,
        buffers: SlotBuffers,
        tiers: Callable[[], Sequence[Tier]],
        stager_deferred: Callable[[], bool],
    ) -> None:
        self.ram = ram
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        self.buffers = buffers
        self.tiers = tiers
        self.stager_deferred = stager_deferred

    def load_staged(self, state: Any, step: int, tier: str, notes: list[str]) -> LoadedShard:
        """Load this rank's staged RAM shard of ``step`` (served by ``tier``) into ``state``
        (:mod:`strata.client.loader`). Sharded tensors not in this shard are left to
        :meth:`fill_pending` and the ``replicas`` phase. Raises :class:`ShardCorrupt` (the live
        state is then partly overwritten) and what the codec raises for a state that does not
        fit (:class:`strata.format.codec.CodecError`)."""
        load = ShardedLoad(self.rank, self.world_size, self.world_size)
        deferred = tier == self.ram.name and self.stager_deferred()
        with SlotLease(self.ram, self.job_id, step, self.rank) as lease:
            m = lease.manifest
            assert m is not None
            component_steps = dict(m.component_steps or {})
            verify = deferred and self.verify and m.verified
            mapped = self.buffers.mapping_of(lease.path)
            if mapped is not None and len(mapped) < m.data_nbytes:
                mapped = None  # mapped before the slot grew: the loader maps it itself
            out = load_shard(
                state,
                m,
                lease.path,
                pool=self.buffers.copy_pool,
                workers=self.buffers.copy_threads,
                verify=verify,
                # A shard its stager verified (or a policy without verification) is copied
                # only; one without checksums yet is checksummed on the way.
                checksum=verify or not m.verified,
                mapped=mapped,
                device_source=lambda: self.buffers.host_view(lease.path),
                resolve=load.resolve,
            )
            if deferred and not m.verified and m.data_nbytes:
                self.ram.update_checksums(
                    self.job_id, step, self.rank, out.chunk_crc32c, out.crc32c
                )
                notes.append(
                    f"ram: step {step} rank {self.rank} had no checksums yet (its writer stopped "
                    "before the checksum pass); checksummed now, not verified against an "
                    "earlier record"
                )
        # Sharded tensors go to the resharding restore, not the loader: their device is unknown
        # here, so such a state is sized by encoding it (after the load, as before).
        hint = None if m.sharded else (m.data_nbytes, out.cuda)
        return LoadedShard(out.tree, load, component_steps, hint)

    def direct_source(self, tier: Tier, step: int) -> DirectShard | None:
        """This rank's copy of ``step`` on ``tier`` when it can be loaded where it lies
        (:meth:`load_direct`: one read of the file, straight into the live state, verified on
        the way) instead of being staged into RAM and then loaded (a copy into tmpfs, then a
        second copy). None when it must be staged: ``tier`` is RAM (already in place) or not a
        file system this process mounts (GCS; the peers, reached through the sidecar), or the
        copy is incremental (its base's chunks lie elsewhere), archive-only, of another world
        size or without checksums while the policy verifies, or its manifest cannot be read
        (the stager then tries it and says why). Never raises."""
        if tier.name == self.ram.name or tier.local_root() is None:
            return None
        path = tier.data_path(self.job_id, step, self.rank)
        if path is None:
            return None
        try:
            m = tier.get_manifest(self.job_id, step, self.rank)
        except (TierError, OSError):
            return None
        if (
            m.refs is not None
            or m.components is not None
            or m.world_size != self.world_size
            or (self.verify and not m.verified)
        ):
            return None
        return DirectShard(tier, path, m)

    def load_direct(self, state: Any, shard: DirectShard) -> LoadedShard:
        """Load ``shard`` (:meth:`direct_source`) into ``state`` from where it lies, checking
        every chunk's CRC32C against its manifest while copying (unless the policy does not
        verify). The kernel is asked to read the whole file ahead (``POSIX_FADV_WILLNEED``) so
        that the copy threads find it cached. Nothing is staged into RAM: the next save writes
        RAM. Raises :class:`ShardCorrupt` (the live state is then partly overwritten: quarantine
        the copy and plan again), ``OSError`` (the file cannot be opened or mapped: nothing was
        written; stage it instead) and what the codec raises for a state that does not fit."""
        m = shard.manifest
        load = ShardedLoad(self.rank, self.world_size, self.world_size)
        with open(shard.path, "rb") as f:
            if m.data_nbytes and hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):
                    os.posix_fadvise(f.fileno(), 0, m.data_nbytes, os.POSIX_FADV_WILLNEED)
        out = load_shard(
            state,
            m,
            shard.path,
            pool=self.buffers.copy_pool,
            workers=self.buffers.copy_threads,
            verify=self.verify,
            checksum=self.verify,
            resolve=load.resolve,
        )
        hint = None if m.sharded else (m.data_nbytes, out.cuda)
        return LoadedShard(out.tree, load, dict(m.component_steps or {}), hint)

    def fill_pending(self, load: ShardedLoad, step: int, notes: list[str]) -> None:
        """Slices of sharded tensors that no owner sent (after the ``replicas`` phase), read
        from the tiers' shards of ``step``. Raises what reading raises."""
        if not load.pending:
            return
        reader = ShardReader(self.tiers(), self.job_id, step)
        try:
            load.fill_from_tiers(reader)
        finally:
            notes.extend(reader.notes)
            reader.close()

    def check_resharded(
        self, step: int, saved_world: int, tiers: Sequence[Tier], incarnation: str
    ) -> ReshardCheck:
        """Read the manifests of every saved rank of ``step`` (written by ``saved_world`` ranks
        of ``incarnation``) from ``tiers`` (this rank's reshard sources, nearest first) and find
        the per-rank values (:func:`strata.restore.reshard.per_rank_values`). Nothing is loaded
        into the live state. Never raises: a failure is the check's ``error``."""
        reader = ShardReader(tiers, self.job_id, step, incarnation)
        src = self.rank if self.rank < saved_world else self.rank % saved_world
        try:
            manifests = [reader.manifest(r) for r in range(saved_world)]
        except Exception as exc:  # every rank learns of it in the reshard-check phase
            return ReshardCheck(
                reader, src, saved_world, PerRankValues(), f"rank {self.rank}: {exc}"
            )
        return ReshardCheck(reader, src, saved_world, per_rank_values(manifests), None)

    def read_resharded(self, state: Any, check: ReshardCheck, notes: list[str]) -> ReshardRead:
        """Load the step of ``check`` (:meth:`check_resharded`) into ``state`` at this world size.

        Rank r loads its per-rank values (non-sharded tensors, RNG, dataloader state) from saved
        rank r when that rank existed, else from saved rank ``r % saved_world``
        (:data:`strata.restore.reshard.PER_RANK_RULE`); every sharded tensor gets the slice this
        rank holds now from the saved owners' shards. Closes the check's reader. Never raises:
        a failure is the result's ``error``.
        """
        reader, src = check.reader, check.source_rank
        step = reader.step
        load = ShardedLoad(self.rank, self.world_size, check.saved_world)
        err = None
        tree: Any = None
        parent = ""
        try:
            m = reader.manifest(src)
            parent = m.incarnation
            data = _unsharded_bytes(reader, src, m)

            def resolve(entry: Any, live: Any, _chunk: Any, path: str) -> Any:
                # The sharded chunks were not read: every one is filled from the tiers, only the
                # slice this rank holds now (ShardedLoad.fill_from_tiers).
                return load.resolve(entry, live, None, path)

            tree = codec.load_into(state, m, data, where=f"step {step} rank {src}", resolve=resolve)
            load.fill_from_tiers(reader)
        except Exception as exc:  # any failure (a device copy, NCCL): every rank learns of it
            err = f"rank {self.rank}: {exc}"
        finally:
            check.close(notes)
        return ReshardRead(
            tree, src, parent, reader.nbytes_read, reader.nbytes_needed, err, list(reader.served)
        )


def _unsharded_bytes(reader: ShardReader, rank: int, m: Manifest) -> mmap.mmap:
    """A buffer of ``m.data_nbytes`` bytes holding, verified, the storages of ``rank``'s shard
    that no sharded chunk owns (per-rank values, plain tensors); the rest stays zero and is
    never read (the sharded slices come from :meth:`ShardedLoad.fill_from_tiers`). Storages
    whose checksum chunks touch are read together."""
    owned = {e.tensor for e in m.sharded if e.tensor is not None}
    wanted = sorted(
        {te.storage for i, te in enumerate(m.tensors) if i not in owned},
        key=lambda j: m.storages[j].offset,
    )
    buf = mmap.mmap(-1, max(1, m.data_nbytes))  # anonymous: untouched pages cost no memory
    spans: list[list[int]] = []
    cs = m.chunk_size
    for j in wanted:
        se = m.storages[j]
        if se.nbytes == 0:
            continue
        lo, hi = se.offset, se.offset + se.nbytes
        if spans and lo <= -(-spans[-1][1] // cs) * cs:  # within the last span's final chunk
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    for lo, hi in spans:
        buf[lo:hi] = reader.read(rank, lo, hi - lo)
    return buf
