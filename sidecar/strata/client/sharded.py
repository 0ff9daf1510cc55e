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
   (:class:`ShardReader`: this node's RAM, the PVC, GCS, nearest first): only the byte span of
   each saved chunk that overlaps this rank's slice, rounded out to the checksummed pieces that
   verify it (128 KiB sub-chunks where recorded, else 4 MiB chunks; ranged reads on every tier,
   GCS included).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.client import device as devices
from strata.client.device import Device
from strata.errors import CodecError, RestoreError, ShardUnavailable, TierError
from strata.format import placement
from strata.format.codec import dtype_from_name
from strata.format.incremental import read_unit, same_logical_shard
from strata.format.manifest import Manifest, ShardedEntry
from strata.tiers.base import Tier
from strata.tiers.references import chunk_span, read_logical

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
                    _copy_in(t, buf)

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
                    piece = reader.region(saved_rank, m, e.tensor, e.offsets, ov, p.path)
                    _copy_in(placement.sub(p.layout.local, need[0], ov), piece)
                    covered += placement.region_numel(ov[1])
                if covered != placement.region_numel(need[1]):
                    raise RestoreError(
                        f"{p.path}: the shards of step {reader.step} cover {covered} of the "
                        f"{placement.region_numel(need[1])} elements this rank needs (slice "
                        f"{need}); a rank wrote a different state structure than the others "
                        "(every rank must save the same tensors in the same order)"
                    )


EDGE_CACHE_CHUNKS = 8
"""Verified pieces (sub-chunks, or chunks without sub-chunk CRCs) a :class:`ShardReader` keeps
(first and last of each read)."""


class ShardReader:
    """Reads saved shards of one step (any rank) from ``tiers`` (nearest first), verified.

    Every tier alike: only the checksum chunks covering the bytes asked for, by ranged reads
    (:func:`strata.tiers.references.read_logical`: ``pread`` of a RAM or PVC file, ranged GETs
    on GCS, an incremental copy's referenced chunks from its base), each chunk checked against
    the manifest's (logical) CRC32C. Archive-only copies are never read. A copy that fails is
    noted and the next tier is tried. ``nbytes_read``: bytes read from the tiers so far;
    ``nbytes_needed``: the bytes the caller asked for (the difference is the chunk rounding).
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
        self.nbytes_read = 0
        self.nbytes_needed = 0
        self._edges: OrderedDict[tuple[int, int], bytes] = OrderedDict()

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
        zeros = [0] * len(te.shape)
        return self.region(rank, m, idx, zeros, (zeros, te.shape), where)

    def region(
        self,
        rank: int,
        m: Manifest,
        idx: int,
        origin: Sequence[int],
        box: tuple[Sequence[int], Sequence[int]],
        where: str,
    ) -> torch.Tensor:
        """The part ``box`` (global (offsets, lengths)) of saved tensor ``idx`` of ``rank``'s
        shard, a chunk whose first element is at global ``origin``, as a new CPU tensor of shape
        ``box[1]``. Only the bytes from the box's first element to its last are read (all of
        them for a box of leading-dimension rows, as FSDP shards): verified bytes."""
        te = m.tensors[idx]
        se = m.storages[te.storage]
        dt = dtype_from_name(te.dtype, where)
        lens = [int(n) for n in box[1]]
        if any(n == 0 for n in lens):
            return torch.empty(lens, dtype=dt)
        esize = torch.empty(0, dtype=dt).element_size()
        lo = [int(b) - int(o) for b, o in zip(box[0], origin, strict=True)]
        first = te.storage_offset + sum(i * st for i, st in zip(lo, te.stride, strict=True))
        last = first + sum((n - 1) * st for n, st in zip(lens, te.stride, strict=True))
        raw = self.read(rank, se.offset + first * esize, (last - first + 1) * esize)
        st = torch.frombuffer(raw, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=dt).set_(st, 0, lens, list(te.stride))

    def read(self, rank: int, offset: int, nbytes: int) -> bytearray:
        """``nbytes`` bytes at ``offset`` of ``rank``'s logical data object, verified by its
        sub-chunk or chunk CRCs (the covering pieces are read:
        :func:`strata.tiers.references.chunk_span`). The first and last piece of every read are
        kept (:data:`EDGE_CACHE_CHUNKS`, least recently used out): the next slice of a
        neighbouring tensor starts in the piece this one ended in, and is not read again."""
        m = self.manifest(rank)
        if nbytes == 0:
            return bytearray()
        self.nbytes_needed += nbytes
        cs = read_unit(m)
        start, stop = chunk_span(m, offset, nbytes)
        out = bytearray(stop - start)
        view = memoryview(out)
        k, last = start // cs, (stop - 1) // cs
        while k <= last:
            cached = self._edges.get((rank, k))
            if cached is not None:
                self._edges.move_to_end((rank, k))
                view[k * cs - start : k * cs - start + len(cached)] = cached
                k += 1
                continue
            j = k
            while j + 1 <= last and (rank, j + 1) not in self._edges:
                j += 1
            lo, hi = k * cs, min((j + 1) * cs, stop)
            buf = self._read_verified(rank, m, lo, hi)
            view[lo - start : hi - start] = buf
            for edge in {k, j} & {start // cs, last}:
                a = edge * cs - lo
                self._remember((rank, edge), bytes(buf[a : a + cs]))
            k = j + 1
        view.release()
        if start == offset and stop - start == nbytes:
            return out
        return out[offset - start : offset - start + nbytes]

    def _remember(self, key: tuple[int, int], chunk: bytes) -> None:
        self._edges[key] = chunk
        self._edges.move_to_end(key)
        while len(self._edges) > EDGE_CACHE_CHUNKS:
            self._edges.popitem(last=False)

    def _read_verified(self, rank: int, m: Manifest, start: int, stop: int) -> bytearray:
        for tier in self._tiers_for(rank):
            try:
                held = self._held(tier, rank, m)
                # Another tier's copy may verify coarser pieces (no sub-chunk CRCs): rounded
                # out to its own.
                lo, hi = chunk_span(held, start, stop - start)
                buf = read_logical(tier, self.job_id, self.step, rank, held, lo, hi)
            except (TierError, OSError) as exc:
                self.notes.append(f"step {self.step} rank {rank}: {tier.name}: {exc}")
                continue
            self.nbytes_read += len(buf)
            if (lo, hi) != (start, stop):
                return buf[start - lo : stop - lo]
            return buf
        raise RestoreError(
            f"rank {rank}'s shard of step {self.step}: no tier served verified bytes "
            f"({'; '.join(self.notes[-3:])})"
        )

    def _tiers_for(self, rank: int) -> list[Tier]:
        src = self._manifests[rank][1]
        return [src] + [t for t in self.tiers if t is not src]

    def _held(self, tier: Tier, rank: int, m: Manifest) -> Manifest:
        """The manifest of ``tier``'s copy of ``rank``'s shard: ``m`` where it came from, else
        ShardUnavailable unless that copy holds the same logical bytes (and is not archive-only)."""
        if tier is self._manifests[rank][1]:
            return m
        held = tier.get_manifest(self.job_id, self.step, rank)
        if not same_logical_shard(held, m) or held.components is not None:
            raise ShardUnavailable(f"{tier.name} holds another copy of rank {rank}")
        return held

    def close(self) -> None:
        """Forget the manifests and cached chunks (a later read reads them again), and the
        local copies tiers without ranged reads fetched for this reader
        (:meth:`strata.tiers.base.Tier.drop_fetched`)."""
        self._manifests.clear()
        self._edges.clear()
        for tier in self.tiers:
            tier.drop_fetched()


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same shape and dtype). A copy between host and device memory goes
    through the device seam's side stream (:func:`strata.client.device.copy_now`), which waits
    for the device's current stream and returns when the bytes are in place: a chunk of the
    registered RAM slot, a piece a resharding read returned, a received buffer. Strided sides are
    first gathered on their own side (a contiguous device or host buffer), so the transfer itself
    is one contiguous copy. Host to host and device to device copy in place (one stream's
    order)."""
    dev = devices.active()
    d_index, s_index = dev.index_of(dst), dev.index_of(src)
    if (d_index is None) == (s_index is None) or dst.dtype != src.dtype:
        dst.copy_(src)
        return
    if not src.is_contiguous():
        src = src.contiguous()  # on src's side: a device-side gather, or a host-side one
    if dst.is_contiguous() and dst.shape == src.shape:
        devices.copy_now(dev, dst, src)
        return
    landing = dev.empty_like(src, d_index)  # contiguous, on dst's side
    devices.copy_now(dev, landing, src)
    dst.copy_(landing)  # on dst's side (device to device: the current stream, after the copy)


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
    _copy_in(out, t)
    return out


def _pread(f: Any, buf: bytearray, start: int) -> int:
    return os.preadv(f.fileno(), [memoryview(buf)], start)
