"""``strata export``: a step's global state as safetensors files with an index, or as a
torch.distributed.checkpoint (DCP) directory, so the ecosystem's tools load it.

Reading: every rank's shard of the step from the nearest location that holds a copy that
verifies (locations in restore order: RAM, PVC, GCS), checked against its manifest's CRC32Cs
before anything is decoded; nothing is quarantined (read-only).

Names: key paths joined with ``.`` (see :mod:`strata.cli.tree`), e.g. ``model.layers.0.weight``.

Global state (:func:`global_state`): a key whose tensors are equal on every rank (replicated
state, DDP) is written once; a key that differs between ranks (or exists on some only) is written
per rank as ``rank<R>/<key>``. A sharded tensor (a DTensor or a declared-replicated tensor:
a ``{"__sharded__": i}`` node with its global shape and each chunk's offsets in the manifest) is
reassembled into its global tensor from the chunks of every rank.

Outputs (``dst`` must be empty or absent):

- safetensors: ``model-00001-of-0000N.safetensors`` (at most ``max_shard_bytes`` each) and
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {key:
  file}}``, the Hugging Face layout). Tied tensors (one storage under several names) are
  written once, under the first name: the others are left out of ``weight_map`` and listed in
  the index's ``metadata.tied_weights`` and in the file's metadata as ``{alias: kept name}``
  (the convention of ``safetensors.torch.save_model``; loaders that tie weights re-tie them). safetensors stores tensors only: the other leaves (step
  counters, learning rates, RNG tuples) go to ``non_tensor_state.json``.
- dcp: a DCP checkpoint of the flat ``{key: value}`` dict (tensors and the other leaves),
  loadable with ``torch.distributed.checkpoint.load``.

Needs torch (the ``torch`` extra).
"""

from __future__ import annotations

import json
import math
import mmap
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata.cli.locations import Location, NotFound, UsageError
from strata.config import TIER_ORDER
from strata.errors import StrataError, TierError
from strata.format import codec
from strata.format.manifest import Manifest
from strata.tiers.references import fetch_full

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
INDEX_NAME = "model.safetensors.index.json"
NON_TENSOR_NAME = "non_tensor_state.json"


class ExportError(StrataError):
    """No location holds a verified copy of some rank's shard (exit status 1)."""


@dataclass
class RankState:
    rank: int
    manifest: Manifest
    source: str
    """The location that served it."""
    leaves: dict[str, Any]
    """key path -> tensor or other leaf value."""
    skipped: list[str] = field(default_factory=list)


def flatten(obj: Any, path: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """A decoded state tree as ``{key path: leaf}`` (dicts, lists and tuples are descended)."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = enumerate(obj)
    else:
        if path in out:
            raise ExportError(f"two leaves map to the key {path!r}; export cannot name them apart")
        out[path] = obj
        return out
    for k, v in items:
        flatten(v, f"{path}.{k}" if path else str(k), out)
    return out


def _load_data(path: Path, nbytes: int) -> Any:
    """The first ``nbytes`` of ``path`` as a private (copy-on-write) mapping torch can wrap."""
    if nbytes == 0:
        return bytearray()
    with open(path, "rb") as f:
        return mmap.mmap(
            f.fileno(), nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )


def read_rank(
    locations: Sequence[Location], job: str, step: int, rank: int, scratch: Path
) -> RankState:
    """Rank ``rank``'s shard of ``step`` from the first location that serves a verified copy."""
    skipped: list[str] = []
    for loc in locations:
        tier = loc.tier
        try:
            m = tier.get_manifest(job, step, rank)
            if not m.verified:
                raise TierError("no checksums recorded yet (its writer is computing them)")
            if m.refs is not None:  # an incremental copy: reassembled with its base's chunks
                path = scratch / f"rank-{rank}.data"
                m = fetch_full(tier, job, step, rank, m, path, quarantine=False)
            elif (local := tier.data_path(job, step, rank)) is not None:  # checked in place
                tier.verify_shard(job, step, rank)
                path = local
            else:
                path = scratch / f"rank-{rank}.data"
                m = tier.fetch_shard(job, step, rank, path, verify=True)
            state = codec.load(m, _load_data(path, m.data_nbytes), f"{loc.spec} rank {rank}")
        except (TierError, OSError) as exc:
            skipped.append(f"{loc.spec}: {exc}")
            continue
        return RankState(rank, m, loc.spec, flatten(state), skipped)
    raise ExportError(
        f"no location serves a verified copy of rank {rank} of step {step} of job {job!r}: "
        + "; ".join(skipped)
    )


def _same(values: Sequence[Any]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(
            isinstance(v, torch.Tensor)
            and v.dtype == first.dtype
            and v.shape == first.shape
            and torch.equal(v, first)
            for v in values[1:]
        )
    return all(type(v) is type(first) and v == first for v in values[1:])


SHARDED_TAG = "__sharded__"
"""Tree node of a sharded tensor (DTensor, declared-replicated) in a manifest."""


def _sharded_chunks(rs: RankState) -> dict[str, tuple[Any, Any]]:
    """key path -> (the manifest's sharded entry, this rank's chunk or None) of every sharded
    tensor of one rank (manifests without sharded tensors: empty)."""
    from strata.cli.tree import walk

    entries = rs.manifest.sharded
    out = {}
    for path, node in walk(rs.manifest.tree):
        if isinstance(node, dict) and SHARDED_TAG in node:
            idx = int(node[SHARDED_TAG])
            if not 0 <= idx < len(entries):
                raise ExportError(f"rank {rs.rank}: {path} names sharded tensor {idx}, absent")
            out[path] = (entries[idx], rs.leaves.get(path))
    return out


def _reassemble(path: str, pieces: Sequence[tuple[Any, Any]]) -> torch.Tensor:
    """The global tensor of ``path`` from every rank's (entry, chunk); each region is written
    by the rank holding its bytes (replicas only reference it). ExportError when a region has
    no bytes or the chunks do not cover the tensor."""
    first = pieces[0][0]
    out = torch.empty(list(first.global_shape), dtype=codec.dtype_from_name(first.dtype, path))
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
    for entry, chunk in pieces:
        if list(entry.global_shape) != list(first.global_shape) or entry.dtype != first.dtype:
            raise ExportError(f"{path}: ranks disagree on its global shape or dtype")
        key = (tuple(entry.offsets), tuple(entry.lengths))
        if chunk is not None:
            regions[key] = chunk
        else:
            regions.setdefault(key, None)
    covered = 0
    for (offsets, lengths), chunk in regions.items():
        if chunk is None:
            raise ExportError(
                f"{path}: no rank holds the bytes of the chunk at {list(offsets)} "
                f"(size {list(lengths)}); the step is incomplete"
            )
        index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        out[index] = chunk.reshape(lengths)
        covered += math.prod(lengths)
    if covered != out.numel():
        raise ExportError(
            f"{path}: the chunks cover {covered} of {out.numel()} elements; the step is incomplete"
        )
    return out


def global_state(ranks: Sequence[RankState]) -> tuple[dict[str, Any], list[str]]:
    """The global ``{key: leaf}`` of all ranks (see the module docstring) and notes.

    The one place ranks are combined: sharded tensors (manifests with per-tensor global
    placement) are reassembled from their chunks first; the rest is merged key by key.
    """
    sharded: dict[str, list[tuple[Any, Any]]] = {}
    for rs in ranks:
        for path, piece in _sharded_chunks(rs).items():
            sharded.setdefault(path, []).append(piece)
    out: dict[str, Any] = {p: _reassemble(p, pieces) for p, pieces in sharded.items()}
    plain = [{k: v for k, v in rs.leaves.items() if k not in sharded} for rs in ranks]
    if len(ranks) == 1:
        return {**plain[0], **out}, []
    keys: dict[str, None] = {}
    for leaves in plain:
        keys.update(dict.fromkeys(leaves))
    per_rank: list[str] = []
    for key in keys:
        values = [leaves[key] for leaves in plain if key in leaves]
        if len(values) == len(ranks) and _same(values):
            out[key] = values[0]
            continue
        per_rank.append(key)
        for rs, leaves in zip(ranks, plain, strict=True):
            if key in leaves:
                out[f"rank{rs.rank}/{key}"] = leaves[key]
    notes = (
        [f"{len(per_rank)} key(s) differ between ranks and are written per rank as rank<R>/<key>"]
        if per_rank
        else []
    )
    if sharded:
        notes.append(f"{len(sharded)} sharded tensor(s) reassembled from their chunks")
    return out, notes


def read_step(
    locations: Sequence[Location],
    job: str,
    step: int,
    scratch: Path,
    advance: Callable[[int, str], None],
) -> list[RankState]:
    """Every rank's shard of ``step`` (world size from the first manifest found)."""
    ordered = sorted(locations, key=lambda loc: TIER_ORDER.index(loc.kind))
    world = None
    for loc in ordered:
        listing = loc.tier.list_steps(job).get(step)
        if listing is not None and listing.world_size is not None:
            world = listing.world_size
            break
    if world is None:
        raise NotFound(
            f"step {step} of job {job!r}: no committed manifest in "
            f"{', '.join(loc.spec for loc in locations)}; `strata list` shows the steps"
        )
    out = []
    for r in range(world):
        rs = read_rank(ordered, job, step, r, scratch)
        advance(rs.manifest.data_nbytes, f"rank {r}")
        out.append(rs)
    return out


def _check_dst(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UsageError(f"{dst}: exists and is not an empty directory; pick a new directory")
    dst.mkdir(parents=True, exist_ok=True)


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x) for x in v]
    return repr(v)


def write_safetensors(
    state: dict[str, Any], dst: Path, meta: dict[str, Any], max_shard_bytes: int
) -> dict[str, Any]:
    """Tensors into size-capped safetensors files plus the index; other leaves to JSON."""
    from safetensors.torch import save_file

    every = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    others = {k: _jsonable(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
    tied = tied_names(every)
    tensors = {k: v for k, v in every.items() if k not in tied}
    groups: list[list[str]] = [[]]
    size = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    weight_map: dict[str, str] = {}
    files = []
    for i, keys in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        # safetensors refuses views sharing memory: each tensor gets its own contiguous copy.
        part = {k: tensors[k].detach().contiguous().clone() for k in keys}
        # safetensors.torch.save_model's convention: a dropped alias names the kept tensor
        aliases = {a: k for a, k in tied.items() if k in part}
        save_file(part, str(dst / name), metadata={**aliases, "format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index: dict[str, Any] = {"metadata": {"total_size": total, **meta}, "weight_map": weight_map}
    if tied:
        index["metadata"]["tied_weights"] = dict(sorted(tied.items()))
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (dst / NON_TENSOR_NAME).write_text(json.dumps(others, indent=2) + "\n")
    return {
        "files": [*files, INDEX_NAME, NON_TENSOR_NAME],
        "tensors": len(tensors),
        "tied": len(tied),
        "other_leaves": len(others),
        "tensor_bytes": total,
    }


def tied_names(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Tied tensors (one storage under several names, e.g. an embedding and the output head):
    ``{alias: kept name}``, the kept name being the first in ``tensors``' order. Only exact
    aliases (same bytes: storage, offset, shape, strides, dtype) count; overlapping views of
    different shapes are written separately. Empty tensors are never tied."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for k, t in tensors.items():
        if t.numel() == 0:
            continue
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key in first:
            out[k] = first[key]
        else:
            first[key] = k
    return out


def write_dcp(state: dict[str, Any], dst: Path) -> dict[str, Any]:
    """The flat state as a single-process DCP checkpoint in ``dst``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        # "torch.distributed is disabled/uninitialized, assuming ... a single process": intended.
        warnings.simplefilter("ignore", UserWarning)
        save(dict(state), storage_writer=FileSystemWriter(str(dst)))
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "files": sorted(p.name for p in dst.iterdir()),
        "tensors": len(tensors),
        "other_leaves": len(state) - len(tensors),
        "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors),
    }


def export(
    locations: Sequence[Location],
    job: str,
    step: int,
    fmt: str,
    dst: Path,
    advance: Callable[[int, str], None],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Read, combine and write (see the module docstring); returns the report."""
    if fmt not in ("safetensors", "dcp"):
        raise UsageError(f"--to {fmt!r}: choose safetensors or dcp")
    _check_dst(dst)
    with tempfile.TemporaryDirectory(prefix="strata-export-") as tmp:
        ranks = read_step(locations, job, step, Path(tmp), advance)
        state, notes = global_state(ranks)
        meta = {"strata_job": job, "strata_step": step, "strata_world_size": len(ranks)}
        written = (
            write_safetensors(state, dst, meta, max_shard_bytes)
            if fmt == "safetensors"
            else write_dcp(state, dst)
        )
    return {
        "job": job,
        "step": step,
        "format": fmt,
        "dir": str(dst),
        "world_size": len(ranks),
        "sources": {rs.rank: rs.source for rs in ranks},
        "skipped": [s for rs in ranks for s in rs.skipped],
        "notes": notes,
        **written,
    }
