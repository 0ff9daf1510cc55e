"""Restoring sharded tensors (DTensors, declared-replicated tensors) into a live state, at the
same or another world size and mesh (docs/architecture.md "Sharded state").

:class:`ShardedLoad` is the :data:`strata.format.codec.Resolver` the checkpointer hands to
``load_into``. For every sharded tensor of the checkpoint it compares the live tensor's layout
(this rank's slice of the global tensor) with what the loaded shard holds:

1. the shard holds exactly the live chunk (same world size and mesh, this rank was the owner):
   copied at once (a RAM hit stays a RAM hit);
2. same layout, another rank of the replica group owned it (a replicated tensor written once):
   received from the owner over torch.distributed point-to-point (:meth:`exchange`), the owner
   sending its chunk; no tier is read;
3. anything else (another world size, another mesh, a plain tensor restored from DTensors):
   the slices it needs are read from the saved owners' shards in the tiers
   (:class:`ShardReader`: this node's RAM, the PVC, GCS, nearest first), each read verified
   against the manifest's chunk CRC32Cs (files: only the chunks covering the bytes needed; GCS:
   the whole shard, fetched once and verified).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.client import device as devices
from strata.client.device import Device
from strata.errors import CodecError, RestoreError, ShardCorrupt, ShardUnavailable, TierError
from strata.format import placement
from strata.format.codec import dtype_from_name
from strata.format.crc import chunk_crcs
from strata.format.incremental import logical_chunk_crcs, logical_nbytes, same_logical_shard
from strata.format.manifest import Manifest, ShardedEntry
from strata.tiers.base import Tier

log = logging.getLogger("strata.client")


@dataclass
class _Pending:
    entry: ShardedEntry
    layout: placement.Layout
    path: str
    index: int


@dataclass
class ShardedLoad:
    """Resolver of sharded tensors for one restore of rank ``rank`` of ``world_size``.

    ``saved_world_size``: the world size the checkpoint was written with.
    """

    rank: int
    world_size: int
    saved_world_size: int
    pending: list[_Pending] = field(default_factory=list)
    sends: list[tuple[int, torch.Tensor, list[int]]] = field(default_factory=list)
    """(tag, chunk, receivers) this rank owns and sends to its replicas."""
    recvs: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)
    """(tag, live chunk, owner) this rank receives from the owner."""
    _count: int = 0

    def resolve(self, entry: ShardedEntry, live: Any, chunk: torch.Tensor | None, path: str) -> Any:
        """See the module docstring; returns the live tensor (or a new one when none is live)."""
        index = self._count
        self._count += 1
        dtype = dtype_from_name(entry.dtype, path)
        if placement.is_dtensor(live):
            layout = placement.dtensor_layout(live, self.rank, path)
        elif isinstance(live, torch.Tensor):
            layout = placement.replicated_layout(live, self.world_size)
        else:
            live = torch.empty(entry.global_shape, dtype=dtype)
            if entry.param:
                live = torch.nn.Parameter(live, requires_grad=entry.requires_grad)
            layout = placement.replicated_layout(live, self.world_size)
        if list(layout.global_shape) != entry.global_shape or layout.dtype != dtype:
            raise CodecError(
                f"the checkpoint holds {entry.dtype}{entry.global_shape} (global) at {path} but "
                f"the live tensor is {str(layout.dtype).removeprefix('torch.')}"
                f"{list(layout.global_shape)}: the model does not match the checkpoint (another "
                "architecture or configuration?); build the same model or restore fresh"
            )
        if placement.region_numel(layout.region[1]) == 0:
            return live
        same = self.saved_world_size == self.world_size and placement.same_layout(entry, layout)
        with torch.no_grad():
            if chunk is not None and entry.region == layout.region:
                _copy_in(layout.local, chunk)
                if same:
                    receivers = [r for r in layout.groups.get(layout.region, []) if r != self.rank]
                    if receivers:
                        self.sends.append((index, layout.local, receivers))
                return live
        if same and entry.owner != self.rank:
            self.recvs.append((index, layout.local, entry.owner))
            return live
        self.pending.append(_Pending(entry, layout, path, index))
        return live

    def exchange(self, group: Any = None) -> None:
        """Owners send their chunks to the replicas that did not store them (every rank calls
        this, in the same order of entries; a no-op without torch.distributed)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            if self.recvs:
                raise RestoreError(
                    f"rank {self.rank}: {len(self.recvs)} replicated tensors were stored by other "
                    "ranks, and torch.distributed is not initialized to receive them; call "
                    "init_process_group() before restore()"
                )
            return
        dev = devices.active()
        # NCCL carries device tensors only, gloo host tensors (and CUDA ones through a copy):
        # each tensor goes on the wire where the group's backend takes it.
        on_device = dev.wire_on_device(str(dist.get_backend(group)))
        ops = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tag, t, receivers in self.sends:
            src = _on_wire(dev, t.detach(), on_device)
            for r in receivers:
                ops.append(dist.P2POp(dist.isend, src, r, group=group, tag=tag))
        for tag, t, owner in self.recvs:
            where = _wire_index(dev, t, on_device)
            buf = t if t.is_contiguous() and dev.index_of(t) == where else dev.empty_like(t, where)
            staged.append((t, buf))
            ops.append(dist.P2POp(dist.irecv, buf, owner, group=group, tag=tag))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        with torch.no_grad():
            for t, buf in staged:
                if buf is not t:
                    t.copy_(buf)

    def fill_from_tiers(self, reader: ShardReader) -> None:
        """Fill every pending slice from the saved owners' shards (see :class:`ShardReader`)."""
        if not self.pending:
            return
        owners = reader.owned_chunks()
        with torch.no_grad():
            for p in self.pending:
                need = p.layout.region
                covered = 0
                for saved_rank, m, e in owners.get(p.entry.path, []):
                    ov = placement.overlap(need, e.region)
                    if ov is None:
                        continue
                    assert e.tensor is not None
                    src = reader.tensor(saved_rank, m, e.tensor, p.path)
                    piece = placement.sub(src, e.offsets, ov)
                    placement.sub(p.layout.local, need[0], ov).copy_(piece)
                    covered += placement.region_numel(ov[1])
                if covered != placement.region_numel(need[1]):
                    raise RestoreError(
                        f"{p.path}: the shards of step {reader.step} cover {covered} of the "
                        f"{placement.region_numel(need[1])} elements this rank needs (slice "
                        f"{need}); a rank wrote a different state structure than the others "
                        "(every rank must save the same tensors in the same order)"
                    )


class ShardReader:
    """Reads saved shards of one step (any rank) from ``tiers`` (nearest first), verified.

    Files (RAM, PVC): only the chunks covering the bytes read, each checked against the
    manifest's (logical) chunk CRC32Cs. Tiers without files (GCS) and incremental copies (issue
    18): the whole shard, fetched once into a temporary file (reassembled) with verification.
    Archive-only copies are never read. A copy that fails is noted and the next tier is tried.
    """

    def __init__(
        self, tiers: Sequence[Tier], job_id: str, step: int, incarnation: str | None = None
    ) -> None:
        self.tiers = list(tiers)
        self.job_id = job_id
        self.step = step
        self.incarnation = incarnation
        """Only shards of this incarnation are read (None: any)."""
        self.notes: list[str] = []
        self.served: list[str] = []
        """The tiers that served manifests, in the order first used."""
        self._manifests: dict[int, tuple[Manifest, Tier]] = {}
        self._fetched: dict[int, Path] = {}
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.nbytes_read = 0

    def manifest(self, rank: int) -> Manifest:
        """The verified manifest of ``rank``'s shard from the nearest tier holding it."""
        if rank not in self._manifests:
            why = []
            for tier in self.tiers:
                try:
                    m = tier.get_manifest(self.job_id, self.step, rank)
                except TierError as exc:
                    why.append(f"{tier.name}: {exc}")
                    continue
                if not m.verified:
                    why.append(f"{tier.name}: not checksummed yet")
                    continue
                if m.components is not None:
                    why.append(f"{tier.name}: an archive-only copy (never restored)")
                    continue
                if self.incarnation is not None and m.incarnation != self.incarnation:
                    why.append(f"{tier.name}: a copy of incarnation {m.incarnation!r}")
                    continue
                self._manifests[rank] = (m, tier)
                if tier.name not in self.served:
                    self.served.append(tier.name)
                break
            else:
                raise RestoreError(
                    f"rank {rank}'s shard of step {self.step} is in no tier this rank can read "
                    f"({'; '.join(why)})"
                )
        return self._manifests[rank][0]

    def owned_chunks(self) -> dict[str, list[tuple[int, Manifest, ShardedEntry]]]:
        """Per tensor path, every saved chunk with its bytes: (saved rank, manifest, entry)."""
        first = self.manifest(0)
        out: dict[str, list[tuple[int, Manifest, ShardedEntry]]] = {}
        for r in range(first.world_size):
            m = self.manifest(r)
            for e in m.sharded:
                if e.tensor is not None:
                    out.setdefault(e.path, []).append((r, m, e))
        return out

    def tensor(self, rank: int, m: Manifest, idx: int, where: str) -> torch.Tensor:
        """Saved tensor ``idx`` of ``rank``'s shard as a new CPU tensor (verified bytes)."""
        te = m.tensors[idx]
        se = m.storages[te.storage]
        raw = self.read(rank, se.offset, se.nbytes)
        dt = dtype_from_name(te.dtype, where)
        st = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage() if raw else None
        if st is None:
            return torch.empty(te.shape, dtype=dt)
        return torch.empty(0, dtype=dt).set_(st, te.storage_offset, te.shape, te.stride)

    def read(self, rank: int, offset: int, nbytes: int) -> bytearray:
        """``nbytes`` bytes at ``offset`` of ``rank``'s data object, verified by chunk CRCs."""
        m = self.manifest(rank)
        expected = logical_chunk_crcs(m)
        assert expected is not None
        if nbytes == 0:
            return bytearray()
        cs = m.chunk_size
        first, last = offset // cs, (offset + nbytes - 1) // cs
        start, stop = first * cs, min((last + 1) * cs, logical_nbytes(m))
        for tier in self._tiers_for(rank):
            try:
                path = self._file(tier, rank, m)
                with open(path, "rb") as f:
                    buf = bytearray(stop - start)
                    got = f.readinto(memoryview(buf)) if start == 0 else _pread(f, buf, start)
                if got != len(buf):
                    raise ShardCorrupt(f"{path}: truncated ({got} of {len(buf)} bytes)")
                crcs, _ = chunk_crcs(buf, len(buf), cs)
                if crcs != expected[first : last + 1]:
                    raise ShardCorrupt(f"{path}: chunk checksum mismatch in chunks {first}-{last}")
                self.nbytes_read += len(buf)
                return buf[offset - start : offset - start + nbytes]
            except (TierError, OSError) as exc:
                self.notes.append(f"step {self.step} rank {rank}: {tier.name}: {exc}")
        raise RestoreError(
            f"rank {rank}'s shard of step {self.step}: no tier served verified bytes "
            f"({'; '.join(self.notes[-3:])})"
        )

    def _tiers_for(self, rank: int) -> list[Tier]:
        src = self._manifests[rank][1]
        return [src] + [t for t in self.tiers if t is not src]

    def _file(self, tier: Tier, rank: int, m: Manifest) -> Path:
        held = m
        if tier is not self._manifests[rank][1]:
            held = tier.get_manifest(self.job_id, self.step, rank)
            if not same_logical_shard(held, m) or held.components is not None:
                raise ShardUnavailable(f"{tier.name} holds another copy of rank {rank}")
        path = tier.data_path(self.job_id, self.step, rank)
        # an incremental copy stores only changed chunks: fetch_shard reassembles it
        if held.refs is None and path is not None and path.exists():
            return path
        key = (rank, id(tier))
        if key[0] in self._fetched:
            return self._fetched[key[0]]
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="strata-reshard-")
        dst = Path(self._tmp.name) / f"rank-{rank}.data"
        tier.fetch_shard(self.job_id, self.step, rank, dst, verify=True)
        self._fetched[rank] = dst
        return dst

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a device ``dst`` from a host ``src`` (the loader hands the chunk as
    a view of the registered RAM slot when it can) through the device seam's side stream."""
    dev = devices.active()
    fits = dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
    if fits and dev.index_of(dst) is not None and dev.index_of(src) is None:
        devices.copy_now(dev, dst, src)
    else:
        dst.copy_(src)


def _wire_index(dev: Device, t: torch.Tensor, on_device: bool) -> int | None:
    """Where ``t`` travels: None (host memory) unless the wire is device memory, then ``t``'s
    device (a host tensor: the current device)."""
    if not on_device:
        return None
    index = dev.index_of(t)
    return index if index is not None else dev.current_device()


def _on_wire(dev: Device, t: torch.Tensor, on_device: bool) -> torch.Tensor:
    """``t``'s bytes as a contiguous tensor where the group's backend carries them."""
    where = _wire_index(dev, t, on_device)
    if dev.index_of(t) == where and t.is_contiguous():
        return t
    out = dev.empty_like(t, where)
    out.copy_(t)
    return out


def _pread(f: Any, buf: bytearray, start: int) -> int:
    return os.preadv(f.fileno(), [memoryview(buf)], start)
