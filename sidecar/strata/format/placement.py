"""Sharded tensors in a shard manifest: where each rank's chunk lies in the global tensor, and
which rank of a replica group writes it (pure; no I/O; docs/architecture.md "Sharded state").

A tensor of the state is *sharded* when it is a DTensor (any placement on any mesh: ``Shard``,
``_StridedShard``, ``Replicate`` and their combinations; ``Partial`` is refused) or a plain
tensor the caller declared replicated across every rank (``save(..., replicated=...)``, the DDP
rule). Its tree node is ``{"__sharded__": i}`` into :attr:`Manifest.sharded`, a
:class:`ShardedEntry`: global shape and dtype, the slice (``offsets``, ``lengths``, in elements
per dimension) this rank's chunk covers, and ``owner``, the rank that stores the chunk's bytes
(``tensor``: its index in ``Manifest.tensors`` on the owner; None on the other ranks of the
replica group, which only record the reference).

Owner rule (:class:`OwnerChooser`, computed locally by every rank, no collective): the chunks of
a tensor are grouped by the slice they cover; a group with several ranks (replicas) gets the
member with the fewest bytes assigned so far (ties: lowest rank), counting only replicated
chunks, in the order the tensors are encoded. Every rank encodes the same tensors in the same
order with the same global shapes (SPMD), so every rank computes the same owners and the bytes
of a durable step are the state's unique bytes, spread evenly over the replica groups.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.format.manifest import ShardedEntry

SHARDED_TAG = "__sharded__"


def same_layout(entry: ShardedEntry, live: Layout) -> bool:
    """Whether the live tensor's layout splits the tensor exactly as ``entry`` was saved."""
    return (
        entry.mesh == live.mesh
        and entry.mesh_shape == live.mesh_shape
        and entry.placements == live.placements
        and entry.global_shape == list(live.global_shape)
    )


def replicated_rule(
    replicated: bool | Collection[str] | None, root: str = "state"
) -> Callable[[str], bool] | None:
    """The predicate on tree paths for ``save(..., replicated=...)``.

    ``True``: every plain tensor of the state is identical on every rank (DDP: pass it when the
    state holds only the model and optimizer, whose values DDP keeps equal). A collection of
    top-level keys (``replicated={"model", "optim"}``): the tensors under those keys only (the
    usual DDP case: RNG and dataloader states stay per rank). None/False: no plain tensor is
    replicated (each rank stores its own). DTensors carry their own placement and ignore this.
    """
    if not replicated:
        return None
    if replicated is True:
        return lambda path: True
    if isinstance(replicated, str):
        replicated = [replicated]
    prefixes = tuple(f"{root}[{k!r}]" for k in replicated)
    return lambda path: path.startswith(prefixes)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch DTensor (without importing torch.distributed when it is not)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


@dataclass(frozen=True)
class Layout:
    """How a (live or saved) tensor is split: every chunk's slice and the ranks holding it."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: list[int]
    mesh_shape: list[int]
    placements: str
    local: torch.Tensor
    """This rank's local chunk (a plain tensor)."""
    region: tuple[tuple[int, ...], tuple[int, ...]]
    """This rank's chunk: (offsets, lengths)."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = field(default_factory=dict)
    """Every chunk's slice -> the ranks holding it (ascending); empty chunks left out."""


def dtensor_layout(t: Any, rank: int, path: str) -> Layout:
    """The :class:`Layout` of DTensor ``t`` on global rank ``rank``.

    Raises ``TypeError`` naming ``path`` for ``Partial`` placements (pending reductions: call
    ``.redistribute(placements=[Replicate()...])`` or ``.full_tensor()`` first) and for a rank
    outside the tensor's mesh.
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = tuple(t.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise TypeError(
            f"cannot checkpoint {path}: DTensor with a Partial placement {placements} holds "
            "pending reductions; call .redistribute(placements=[Replicate(), ...]) or "
            ".full_tensor() before saving"
        )
    dm = t.device_mesh
    ranks = dm.mesh.flatten().tolist()
    shape = list(dm.mesh.shape)
    gshape = tuple(int(s) for s in t.shape)
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    mine = None
    for flat, r in enumerate(ranks):
        coord, rem = [], flat
        for n in reversed(shape):
            coord.append(rem % n)
            rem //= n
        coord.reverse()
        lengths, offsets = _compute_local_shape_and_global_offset(gshape, shape, coord, placements)
        region = (tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
        if r == rank:
            mine = region
        if all(n > 0 for n in region[1]) or not gshape:
            groups.setdefault(region, []).append(int(r))
    if mine is None:
        raise TypeError(f"cannot checkpoint {path}: rank {rank} is not in its mesh {ranks}")
    for members in groups.values():
        members.sort()
    return Layout(
        global_shape=gshape,
        dtype=t.dtype,
        mesh=[int(r) for r in ranks],
        mesh_shape=[int(n) for n in shape],
        placements=repr(placements),
        local=t.to_local(),
        region=mine,
        groups=groups,
    )


def replicated_layout(t: torch.Tensor, world_size: int) -> Layout:
    """The :class:`Layout` of a plain tensor identical on every rank of ``world_size``."""
    gshape = tuple(int(s) for s in t.shape)
    region = ((0,) * len(gshape), gshape)
    return Layout(
        global_shape=gshape,
        dtype=t.dtype,
        mesh=[],
        mesh_shape=[],
        placements="",
        local=t,
        region=region,
        groups={region: list(range(world_size))},
    )


class OwnerChooser:
    """The owner rule of the module docstring: least bytes so far among the replicas."""

    def __init__(self) -> None:
        self.load: dict[int, int] = {}

    def owner(self, members: Sequence[int], nbytes: int) -> int:
        if len(members) == 1:
            return members[0]
        best = min(members, key=lambda r: (self.load.get(r, 0), r))
        self.load[best] = self.load.get(best, 0) + nbytes
        return best

    def owners(self, layout: Layout) -> dict[tuple[tuple[int, ...], tuple[int, ...]], int]:
        """Owner of every non-empty chunk of ``layout``, updating the running loads."""
        item = layout.dtype.itemsize
        out = {}
        for region, members in layout.groups.items():
            n = item
            for d in region[1]:
                n *= d
            out[region] = self.owner(members, n)
        return out


def region_numel(lengths: Sequence[int]) -> int:
    n = 1
    for d in lengths:
        n *= d
    return n


def overlap(
    a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection (offsets, lengths) of two slices of one tensor; None when empty."""
    offs, lens = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return tuple(offs), tuple(lens)


def sub(
    t: torch.Tensor, origin: Sequence[int], region: tuple[Sequence[int], Sequence[int]]
) -> torch.Tensor:
    """The part of ``t`` (a chunk starting at global ``origin``) covering global ``region``."""
    out = t
    for d, (o, ro, rl) in enumerate(zip(origin, region[0], region[1], strict=True)):
        out = out.narrow(d, ro - o, rl)
    return out
