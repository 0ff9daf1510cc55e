"""The encoder's memory between saves of one state (:class:`EncodeCache`; used by
:func:`strata.format.codec.encode`). No I/O.

Two levels, both proven against the live state on every save (nothing is assumed unchanged):

- per tensor (:class:`_Cached`): a tensor whose data pointer, shape, strides, dtype and
  ``requires_grad`` are unchanged reuses its manifest entries (~20 us of torch and pydantic
  calls saved per tensor);
- per layout (:class:`Layout`): when every tensor of the state, met in the same order, is the
  tensor of the previous save with the same layout (or a new tensor object with exactly the
  layout of the one it replaces, storage not shared: ``torch.get_rng_state()`` called per
  save), the whole tensor part of the encode is the previous one: the same ``TensorEntry`` /
  ``StorageEntry`` lists, the same data offsets. Everything derived from the layout alone is
  then computed once per layout and reused: the manifest's ``tensors``/``storages`` JSON
  (:class:`LayoutJson`), the copy plan (:mod:`strata.format.datacopy`), the source addresses.
  A new tensor, a resized or re-strided one, another dtype or device, a tensor now sharing a
  storage: the layout is not reused and a full encode builds a new one.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.format.datacopy import Piece
from strata.format.manifest import LayoutJson, StorageEntry, TensorEntry

TENSOR_TAG = "__tensor__"
"""The tree node of a tensor: ``{"__tensor__": index into Manifest.tensors}``."""


class _Miss(Exception):
    """The state does not have the previous save's layout (:class:`Replayer`)."""


@dataclass(frozen=True)
class _Cached:
    tensor: torch.Tensor
    ptr: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    storage_key: int
    storage: StorageEntry
    source: torch.Tensor
    entry: TensorEntry

    def matches(self, t: torch.Tensor) -> bool:
        # The cached source keeps the old storage alive, so no other storage can start at the
        # same address: same data pointer, shape, strides and dtype = the same layout.
        return (
            t is self.tensor
            and t.data_ptr() == self.ptr
            and t.shape == self.shape
            and t.stride() == self.stride
            and t.dtype == self.dtype
            and t.requires_grad == self.requires_grad
        )


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What must be unchanged for a tensor object to keep its layout: ``(data pointer, shape,
    strides, dtype, requires_grad)`` (the storage is kept alive by the cache, so no other
    storage can start at the same address)."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad)


@dataclass
class Layout:
    """The tensor part of one encode, to be reused by the next save of the same state.

    Per tensor *occurrence* in the walk order (a tensor met twice occurs twice): the tensor
    object, its :func:`tensor_key`, the tree node the encoder produced (``{"__tensor__": i}``,
    reused as is) and ``solo`` (True when the occurrence is its tensor's only one and no other
    tensor shares its storage: only then may a new tensor object take its place). ``live[i]``
    is the tensor of ``tensors[i]``; ``sources[s]``/``ptrs[s]`` the uint8 view and address of
    storage ``s``; ``storage_keys`` the ``_cdata`` of every storage (kept alive by
    ``sources``). ``params``: the encode call's ``(root, rank, world_size)``.
    """

    params: tuple[str, int, int]
    tensors: list[TensorEntry]
    storages: list[StorageEntry]
    sources: list[torch.Tensor]
    live: list[torch.Tensor]
    data_nbytes: int
    occ_tensors: list[torch.Tensor]
    occ_keys: list[tuple[Any, ...]]
    occ_nodes: list[dict[str, Any]]
    solo: list[bool]
    storage_keys: set[int]
    ptrs: list[int]
    cuda: bool
    json: LayoutJson
    plans: dict[int, list[list[Piece]]] = field(default_factory=dict)
    """Copy plans by thread count (:func:`strata.format.datacopy.cpu_plan`)."""
    containers: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    """By ``id`` of a plain dict or list of the state: ``(it, its tree node)`` as the last
    replay encoded it (:meth:`Replayer.shared`); the object is held so that its id stays its."""

    @classmethod
    def build(
        cls,
        params: tuple[str, int, int],
        tensors: list[TensorEntry],
        storages: list[StorageEntry],
        sources: list[torch.Tensor],
        live: list[torch.Tensor],
        data_nbytes: int,
        occ_tensors: list[torch.Tensor],
        occ_nodes: list[dict[str, Any]],
        storage_keys: set[int],
    ) -> Layout:
        """The layout of a full encode (its lists are taken, not copied)."""
        uses = [0] * len(storages)
        for te in tensors:
            uses[te.storage] += 1
        seen = [0] * len(tensors)
        for node in occ_nodes:
            seen[node[TENSOR_TAG]] += 1
        solo = [
            seen[node[TENSOR_TAG]] == 1 and uses[tensors[node[TENSOR_TAG]].storage] == 1
            for node in occ_nodes
        ]
        return cls(
            params=params,
            tensors=tensors,
            storages=storages,
            sources=sources,
            live=live,
            data_nbytes=data_nbytes,
            occ_tensors=occ_tensors,
            occ_keys=[tensor_key(t) for t in occ_tensors],
            occ_nodes=occ_nodes,
            solo=solo,
            storage_keys=storage_keys,
            ptrs=[s.data_ptr() for s in sources],
            cuda=any(s.device.type == "cuda" for s in sources),
            json=LayoutJson(tensors, storages),
        )

    def replaced(self, fresh: list[tuple[int, torch.Tensor, torch.Tensor, int]]) -> Layout:
        """This layout with new tensor objects at some occurrences: ``(occurrence, tensor, its
        uint8 source, its storage's _cdata)``; the entries, JSON and copy plans are shared."""
        occ_tensors = list(self.occ_tensors)
        occ_keys = list(self.occ_keys)
        live = list(self.live)
        sources = list(self.sources)
        ptrs = list(self.ptrs)
        keys = set(self.storage_keys)
        for j, t, source, key in fresh:
            i = self.occ_nodes[j][TENSOR_TAG]
            s = self.tensors[i].storage
            keys.discard(self.sources[s].untyped_storage()._cdata)
            keys.add(key)
            occ_tensors[j] = t
            occ_keys[j] = tensor_key(t)
            live[i] = t
            sources[s] = source
            ptrs[s] = source.data_ptr()
        return Layout(
            params=self.params,
            tensors=self.tensors,
            storages=self.storages,
            sources=sources,
            live=live,
            data_nbytes=self.data_nbytes,
            occ_tensors=occ_tensors,
            occ_keys=occ_keys,
            occ_nodes=self.occ_nodes,
            solo=self.solo,
            storage_keys=keys,
            ptrs=ptrs,
            cuda=self.cuda,
            json=self.json,
            plans=self.plans,
            containers=self.containers,
        )


@dataclass
class Replayer:
    """Replay mode of the encoder (:func:`strata.format.codec.encode`, which subclasses this):
    with ``replay`` set, every tensor met must be the previous save's tensor of the same
    occurrence with the same layout (or a new object that may take its place), else
    :class:`_Miss` is raised; the tree is built as usual around the previous tensor nodes, and
    paths are not formatted (an error becomes a miss; the full encode that follows raises it
    with its path). ``fresh``: the new tensor objects accepted, ``(occurrence, tensor, uint8
    source, storage _cdata)`` (:meth:`Layout.replaced`)."""

    replay: Layout | None = None
    cursor: int = 0
    fresh: list[tuple[int, torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    fresh_keys: set[int] = field(default_factory=set)
    containers: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    """:attr:`Layout.containers` of this replay (the containers it met)."""

    def shared(self, obj: dict[str, Any] | list[Any], values: list[Any]) -> Any:
        """Replay mode: the tree node of the plain dict (or list) ``obj`` whose items encode as
        ``values``: the very node the previous replay built for the same object when its keys
        and the values' nodes are the same (``is``), else a new one. A node that stays the
        same object keeps its serialised JSON (:meth:`LayoutJson.tree_json`)."""
        assert self.replay is not None
        prev = self.replay.containers.get(id(obj))
        if prev is not None and prev[0] is obj:
            node = prev[1]
            if (
                len(node) == len(values)
                and all(map(operator.is_, values, node.values() if type(obj) is dict else node))
                and (type(obj) is list or list(node) == list(obj))
            ):
                self.containers[id(obj)] = prev
                return node
        node = dict(zip(obj, values, strict=True)) if type(obj) is dict else values
        self.containers[id(obj)] = (obj, node)
        return node

    def node(self, obj: Any, path: str) -> Any:  # pragma: no cover - the encoder's
        raise NotImplementedError

    def replayed(self, t: torch.Tensor) -> dict[str, Any]:
        """Replay mode: the node of tensor occurrence ``cursor`` when ``t`` has its layout."""
        lay = self.replay
        assert lay is not None
        j = self.cursor
        if j >= len(lay.occ_tensors):
            raise _Miss
        self.cursor = j + 1
        if t is lay.occ_tensors[j]:
            if (t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad) != lay.occ_keys[j]:
                raise _Miss
            return lay.occ_nodes[j]
        return self._fresh(t, j, lay)

    def _replayed_values(self, values: Iterable[Any]) -> list[Any]:
        """Replay mode: the nodes of ``values``, in order. The previous save's tensors are
        checked inline (no call per tensor: ~1 us a tensor, bench W3's 10,000-entry dict)."""
        lay = self.replay
        assert lay is not None
        occ_t, occ_k, occ_n = lay.occ_tensors, lay.occ_keys, lay.occ_nodes
        n = len(occ_t)
        node = self.node
        out: list[Any] = []
        append = out.append
        j = self.cursor
        for v in values:
            if (
                j < n
                and v is occ_t[j]
                and (v.data_ptr(), v.shape, v.stride(), v.dtype, v.requires_grad) == occ_k[j]
            ):
                append(occ_n[j])
                j += 1
            else:
                self.cursor = j
                append(node(v, ""))
                j = self.cursor
        self.cursor = j
        return out

    def _fresh(self, t: torch.Tensor, j: int, lay: Layout) -> dict[str, Any]:
        """A new tensor object where the previous save had another (``torch.get_rng_state()``
        per save): reused when it has exactly the old one's entries and a storage of its own."""
        old = lay.occ_tensors[j]
        if not lay.solo[j] or type(t) is not type(old):
            raise _Miss
        if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_conj() or t.is_neg():
            raise _Miss
        node = lay.occ_nodes[j]
        te = lay.tensors[node[TENSOR_TAG]]
        se = lay.storages[te.storage]
        old_source = lay.sources[te.storage]
        st = t.untyped_storage()
        key = st._cdata
        same = (
            t.device == old_source.device
            and str(t.dtype).removeprefix("torch.") == te.dtype
            and list(t.shape) == te.shape
            and list(t.stride()) == te.stride
            and int(t.storage_offset()) == te.storage_offset
            and t.requires_grad == te.requires_grad
            and st.nbytes() == se.nbytes
            and key not in self.fresh_keys
            and (key not in lay.storage_keys or key == old_source.untyped_storage()._cdata)
        )
        if not same:
            raise _Miss
        self.fresh_keys.add(key)
        source = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
        self.fresh.append((j, t, source, key))
        return node


class EncodeCache:
    """What :func:`encode` learnt about the previous save (pass the same object to every save
    of one state): see the module docstring. It holds the tensors of the last save (and so
    their memory) until the next one."""

    def __init__(self) -> None:
        self.old: dict[int, _Cached] = {}
        self.new: dict[int, _Cached] = {}
        self.layout: Layout | None = None
        """The previous encode's layout (None: none, or one that cannot be reused: sharded
        tensors, conjugate views)."""
        self.layout_hits = 0
        """Encodes that reused the previous layout (tests, benchmarks)."""
