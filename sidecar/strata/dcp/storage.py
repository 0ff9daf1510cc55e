"""The DCP ``StorageWriter`` / ``StorageReader`` over Strata's tiers (see :mod:`strata.dcp`)."""

from __future__ import annotations

import base64
import io
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DcpReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from strata.client.checkpointer import Checkpointer
from strata.client.sharded import ShardReader
from strata.dcp.ids import step_of_checkpoint_id
from strata.errors import RestoreError, TierError
from strata.format.codec import TENSOR_TAG, dtype_from_name
from strata.format.incarnation import Lineage
from strata.format.incremental import logical_nbytes
from strata.format.manifest import Manifest
from strata.restore.plan import LOCAL_TIERS
from strata.tiers.base import Tier
from strata.tiers.eligible import TierSteps, job_lineage, tier_steps
from strata.tiers.records import verify_commit

log = logging.getLogger("strata.dcp")

KEY = "dcp"
"""The one key of the state tree a DCP shard holds."""


def _step_of(checkpoint_id: str | os.PathLike[str] | None, default: int | None) -> int | None:
    if checkpoint_id is None:
        return default
    step = step_of_checkpoint_id(checkpoint_id)
    if step is None:
        raise ValueError(
            "a Strata DCP checkpoint_id is a step number ('3') or a path ending in step-<N> "
            f"(torchtitan's '<folder>/step-3'), got {os.fspath(checkpoint_id)!r}; pass step= to "
            "the StorageWriter/StorageReader instead"
        )
    return step


class _Backed:
    def __init__(self, checkpointer: Checkpointer | None, settings: dict[str, Any]) -> None:
        self._ckpt = checkpointer
        self._settings = settings
        self._own = checkpointer is None

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer (built on first use, when torch.distributed gives the identity)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(**self._settings)
        return self._ckpt

    def close(self) -> None:
        """Close a Checkpointer this object built (waits for background checksums)."""
        if self._own and self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None


class StorageWriter(_Backed, _DcpWriter):
    """DCP storage writer: ``dcp.save`` / ``dcp.async_save`` into Strata step ``step``.

    ``step``: the Strata step (or pass ``checkpoint_id="3"`` or ``".../step-3"`` to ``dcp.save``;
    :mod:`strata.dcp.ids`). ``checkpointer``:
    an existing :class:`strata.Checkpointer`; otherwise ``settings`` (the Checkpointer's keywords:
    ``job_id``, ``ram_dir``, ``pvc_dir``, ``config``, ...) build one. ``write_data`` blocks for
    the copy into the RAM slot and the checksum pass (dcp.save is a blocking call; use
    ``dcp.async_save`` to hide it). Raises RuntimeError with the Checkpointer's error when the
    save fails.
    """

    def __init__(
        self, step: int | None = None, *, checkpointer: Checkpointer | None = None, **settings: Any
    ) -> None:
        _Backed.__init__(self, checkpointer, settings)
        self.step = step
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.step = _step_of(checkpoint_id, self.step)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.step is None:
            raise ValueError("strata.dcp.StorageWriter needs step= (or checkpoint_id='<step>')")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.step is not None
        items: list[dict[str, Any]] = []
        results: list[WriteResult] = []
        ckpt = self.checkpointer
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            entry: dict[str, Any] = {"fqn": item.index.fqn, "kind": "bytes"}
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                entry["data"] = raw
                size = len(raw)
            else:
                td = item.tensor_data
                assert td is not None and isinstance(data, torch.Tensor)
                t = data.detach()
                entry.update(
                    kind="tensor",
                    offset=list(item.index.offset or []),
                    size=list(td.size),
                    chunk_offsets=list(td.chunk.offsets),
                    chunk_sizes=list(td.chunk.sizes),
                    dtype=str(td.properties.dtype).removeprefix("torch."),
                    data=t,
                )
                size = t.numel() * t.element_size()
            items.append(entry)
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=size,
                    storage_data={"rank": ckpt.rank, "item": i},
                )
            )
        # wait_copied(): a save that left bytes in place commits in the background
        if not ckpt.save(self.step, {KEY: items}) or ckpt.wait_copied() is False:
            raise RuntimeError(f"strata: DCP save of step {self.step} failed: {ckpt.last_error}")
        ckpt.wait()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: the readers rebuild DCP's metadata from the shard manifests."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return step_of_checkpoint_id(checkpoint_id) is not None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step))


class StorageReader(_Backed, _DcpReader):
    """DCP storage reader: ``dcp.load`` from Strata step ``step`` (None: the newest intact).

    ``step=None``: the newest step whose every shard this rank (with torch.distributed: every
    rank) can read verified, by commit records (:func:`intact_step`); a newer step with a
    corrupt or missing shard is passed over (said in :attr:`notes` and logged). Same keywords as
    :class:`StorageWriter`. Raises :class:`strata.errors.RestoreError` when no step can be read
    (naming what was searched) or a shard of a given ``step`` cannot be read verified.
    """

    def __init__(
        self, step: int | None = None, *, checkpointer: Checkpointer | None = None, **settings: Any
    ) -> None:
        _Backed.__init__(self, checkpointer, settings)
        self.step = step
        self._reader: ShardReader | None = None
        self._tensors: dict[tuple[int, int], torch.Tensor] = {}
        self.notes: list[str] = []
        """Why newer steps were passed over when ``step`` was None (one line each)."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.step = _step_of(checkpoint_id, self.step)
        self._tensors.clear()
        if self._reader is not None and self._reader.step != self.step:
            self._reader.close()
            self._reader = None

    def _choose_step(self) -> int:
        """The newest step every rank of this load can read intact (see :func:`intact_step`);
        with torch.distributed, every rank agrees on it."""
        ckpt = self.checkpointer
        ckpt.wait()
        step, reader, notes = intact_step(
            ckpt._restore_tiers(), ckpt.job_id, ckpt.restorer.phases.agree_dcp_step
        )
        self.notes = notes
        if step is None or reader is None:
            raise RestoreError(
                f"no intact DCP step of job {ckpt.job_id!r} in any tier this rank can read "
                f"({', '.join(t.name for t in ckpt._restore_tiers())})"
                + (f"; skipped: {'; '.join(notes)}" if notes else "")
            )
        self._reader = reader
        return step

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ckpt = self.checkpointer
        if self.step is None:
            self.step = self._choose_step()
        elif self._reader is None or self._reader.step != self.step:
            self._reader = ShardReader(ckpt._restore_tiers(), ckpt.job_id, self.step)
        reader = self._reader
        assert reader is not None
        world = reader.manifest(0).world_size
        tensors: dict[str, TensorStorageMetadata] = {}
        md: dict[str, Any] = {}
        storage: dict[MetadataIndex, tuple[int, int]] = {}
        for rank in range(world):
            for i, e in enumerate(_items(reader.manifest(rank))):
                fqn = e["fqn"]
                if e["kind"] == "bytes":
                    md[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = (rank, i)
                    continue
                tsm = tensors.get(fqn)
                if tsm is None:
                    props = TensorProperties(dtype=dtype_from_name(e["dtype"], fqn))
                    tsm = TensorStorageMetadata(props, torch.Size(e["size"]), [])
                    tensors[fqn] = md[fqn] = tsm
                tsm.chunks.append(
                    ChunkStorageMetadata(
                        torch.Size(e["chunk_offsets"]), torch.Size(e["chunk_sizes"])
                    )
                )
                storage[MetadataIndex(fqn, torch.Size(e["offset"]))] = (rank, i)
        return Metadata(
            state_dict_metadata=md,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=str(self.step)),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data: dict[MetadataIndex, tuple[int, int]] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reader = self._reader
        assert reader is not None, "read_metadata() first"
        try:
            for req in plan.items:
                rank, i = self.storage_data[req.storage_index]
                m = reader.manifest(rank)
                data_node = _items(m)[i]["data"]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(_bytes(data_node)))
                    continue
                src = self._tensor(rank, m, int(data_node[TENSOR_TAG]), req.storage_index.fqn)
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    src = src.narrow(d, o, n)
                target = planner.resolve_tensor(req).detach()
                target.copy_(src)
                planner.commit_tensor(req, target)
        finally:
            self._tensors.clear()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _tensor(self, rank: int, m: Manifest, idx: int, where: str) -> torch.Tensor:
        key = (rank, idx)
        if key not in self._tensors:
            assert self._reader is not None
            self._tensors[key] = self._reader.tensor(rank, m, idx, where)
        return self._tensors[key]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        super().close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return step_of_checkpoint_id(checkpoint_id) is not None


VERIFY_PIECE = 64 << 20
"""Bytes read at a time when a step is verified before it is chosen."""


def _candidates(
    tiers: Sequence[Tier], job_id: str, notes: list[str], life: Lineage
) -> dict[int, str | None]:
    """step -> incarnation of its commit record (None: no record; the shards must then agree)
    for every step that is committed somewhere: a commit record of an eligible step
    (:mod:`strata.tiers.eligible`) that still describes the shards next to it in a shared tier,
    or every rank's shard committed in the tiers read together."""
    out: dict[int, str | None] = {}
    ranks: dict[int, set[int]] = {}
    worlds: dict[int, int] = {}
    for tier in tiers:
        try:
            listing = tier.list_steps(job_id)
            found = (
                TierSteps()
                if tier.name in LOCAL_TIERS
                else tier_steps(tier, job_id, life, [s for s, e in listing.items() if e.has_commit])
            )
        except (TierError, OSError) as exc:
            notes.append(f"{tier.name}: not searched: {exc}")
            continue
        commits = found.eligible
        for step, c in found.dead.items():
            notes.append(f"{tier.name}: {life.why_dead(c.incarnation, step)}")
        for step, c in commits.items():
            problems = verify_commit(tier, c)
            if problems:
                notes.append(f"{tier.name}: step {step}'s commit record: {'; '.join(problems)}")
            elif not c.archive_only:
                out.setdefault(step, c.incarnation)
        for step, entry in listing.items():
            ranks.setdefault(step, set()).update(entry.committed_ranks)
            if entry.world_size is not None:
                worlds.setdefault(step, entry.world_size)
    for step, held in ranks.items():
        w = worlds.get(step)
        if step not in out and w is not None and set(range(w)) <= held:
            out[step] = None
    return out


def _verify_step(
    tiers: Sequence[Tier], job_id: str, step: int, incarnation: str | None, lineage: Lineage
) -> tuple[ShardReader | None, str]:
    """A reader of ``step`` whose every shard was read verified (chunk CRC32Cs), or why not."""
    reader = ShardReader(tiers, job_id, step)
    try:
        first = reader.manifest(0)
        inc = first.incarnation if incarnation is None else incarnation
        if not lineage.live(inc, step):
            raise RestoreError(lineage.why_dead(inc, step))
        for rank in range(first.world_size):
            m = reader.manifest(rank)
            if m.world_size != first.world_size or m.incarnation != inc:
                raise RestoreError(
                    f"rank {rank}'s shard (incarnation {m.incarnation!r}, world size "
                    f"{m.world_size}) is not of one save with rank 0's (incarnation {inc!r}, "
                    f"world size {first.world_size})"
                )
            size = logical_nbytes(m)
            piece = max(m.chunk_size, VERIFY_PIECE // m.chunk_size * m.chunk_size)
            for off in range(0, size, piece):
                reader.read(rank, off, min(piece, size - off))
    except (RestoreError, TierError, OSError) as exc:
        reader.close()
        return None, f"step {step}: {exc}"
    reader.nbytes_read = 0
    return reader, ""


def intact_step(
    tiers: Sequence[Tier],
    job_id: str,
    gather: Callable[[Any], list[Any]] = lambda x: [x],
) -> tuple[int | None, ShardReader | None, list[str]]:
    """The newest committed step of the live lineage whose every shard reads verified.

    Candidates (newest first) are the steps with a commit record that still describes its
    shards, or with every rank's shard committed in ``tiers`` (nearest first) together; each is
    verified by reading every shard's bytes against its chunk CRC32Cs (a copy that fails is
    passed over for the next tier's). ``gather``: all-gathers one object over the ranks
    (the ``dcp-step`` phase of :class:`strata.client.collectives.RestoreCollectives`); every rank must agree a step is intact before it is chosen.
    Returns (step, its reader holding the verified manifests, notes on the steps passed over);
    (None, None, notes) when no step is intact.
    """
    notes: list[str] = []
    life = job_lineage(tiers, job_id)
    cands = _candidates(tiers, job_id, notes, life)
    everyone = sorted({s for c in gather(sorted(cands)) for s in c}, reverse=True)
    for step in everyone:
        reader, why = (None, f"step {step}: not committed in any tier this rank reads")
        if step in cands:
            reader, why = _verify_step(tiers, job_id, step, cands[step], life)
        verdicts = gather(why)
        if not any(verdicts):
            assert reader is not None
            return step, reader, notes
        if reader is not None:
            reader.close()
        for v in verdicts:
            if v and v not in notes:
                notes.append(v)
                log.warning("strata.dcp: passed over %s", v)
    return None, None, notes


def _items(m: Manifest) -> list[dict[str, Any]]:
    tree = m.tree
    if not isinstance(tree, dict) or not isinstance(tree.get(KEY), list):
        raise RestoreError(
            f"step {m.step} rank {m.rank} was not written by strata.dcp.StorageWriter (no "
            f"{KEY!r} list in its state); load it with Checkpointer.restore"
        )
    items: list[dict[str, Any]] = tree[KEY]
    return items


def _bytes(node: Any) -> bytes:
    if isinstance(node, dict) and "__bytes__" in node:
        return base64.b64decode(node["__bytes__"])
    raise RestoreError(f"a DCP bytes item is stored as {type(node).__name__}, not bytes")
