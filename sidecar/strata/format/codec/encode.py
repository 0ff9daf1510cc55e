"""Encoding: a state tree -> :class:`EncodedState` (tagged JSON tree, tensor and storage
entries, the storages to copy). The format is :mod:`strata.format.codec`'s docstring.
"""

from __future__ import annotations

import base64
import collections
import itertools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.format import placement
from strata.format.codec.common import (
    INT64_MAX,
    INT64_MIN,
    TENSOR_TAG,
    dtype_name,
    is_stateful,
    key_str,
    np_module,
)
from strata.format.datacopy import write_data
from strata.format.encode_cache import EncodeCache, Layout, Replayer, _Cached, _Miss
from strata.format.manifest import (
    ALIGN,
    DEFAULT_CHUNK_SIZE,
    Manifest,
    ShardedEntry,
    StorageEntry,
    TensorEntry,
)

__all__ = ["EncodedState", "dumps", "encode"]


@dataclass
class EncodedState:
    """A state tree split into JSON (``tree``) and storages to copy (``sources``, uint8 views)."""

    tree: Any
    tensors: list[TensorEntry]
    storages: list[StorageEntry]
    sources: list[torch.Tensor]
    """Per storage, a 1-D uint8 tensor over its bytes (on the tensor's device)."""
    data_nbytes: int
    live: list[torch.Tensor] = field(default_factory=list)
    """The tensors encoded (their ``_version`` counters tell whether one changed since)."""
    sharded: list[ShardedEntry] = field(default_factory=list)
    """Sharded tensors (:mod:`strata.format.placement`)."""
    layout: Layout | None = None
    """The reusable layout of this encode (:class:`strata.format.encode_cache.Layout`; None
    without a cache or for states it does not cover): ``tensors``, ``storages``, ``sources``
    and ``live`` are its lists; what depends on the layout alone is cached on it."""

    def manifest(
        self,
        *,
        job_id: str,
        step: int,
        rank: int,
        world_size: int,
        writer_id: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        chunk_crc32c: list[int] | None = None,
        crc32c: int | None = None,
    ) -> Manifest:
        """The shard manifest of this state (checksums None until computed over the data);
        with a :attr:`layout`, its ``tensors``/``storages`` JSON is the layout's, serialised
        once (:meth:`strata.format.manifest.Manifest.with_layout_json`)."""
        lay = self.layout
        m = Manifest(
            job_id=job_id,
            step=step,
            rank=rank,
            world_size=world_size,
            writer_id=writer_id,
            tree=self.tree,
            tensors=self.tensors if lay is None else [],
            storages=self.storages if lay is None else [],
            data_nbytes=self.data_nbytes,
            chunk_size=chunk_size,
            chunk_crc32c=chunk_crc32c,
            crc32c=crc32c,
            sharded=self.sharded,
        )
        if lay is None:
            return m
        # The layout's entries are the encoder's own (validating 10,000 of them checks only
        # their type, ~1 ms): put in as they are, with their cached JSON.
        m = m.model_copy(update={"tensors": lay.tensors, "storages": lay.storages})
        return m.with_layout_json(lay.json)


@dataclass
class _Encoder(Replayer):
    tensors: list[TensorEntry] = field(default_factory=list)
    storages: list[StorageEntry] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    by_storage: dict[int, int] = field(default_factory=dict)
    by_tensor: dict[int, int] = field(default_factory=dict)
    keep_alive: list[Any] = field(default_factory=list)
    nbytes: int = 0
    on_path: set[int] = field(default_factory=set)
    cache: EncodeCache | None = None
    rank: int = 0
    world_size: int = 1
    replicated: Callable[[str], bool] | None = None
    sharded: list[ShardedEntry] = field(default_factory=list)
    by_sharded: dict[int, int] = field(default_factory=dict)
    owners: placement.OwnerChooser = field(default_factory=placement.OwnerChooser)
    sharded_alive: list[Any] = field(default_factory=list)
    """DTensors encoded (their ids stay unique while encoding)."""
    occ_tensors: list[torch.Tensor] = field(default_factory=list)
    occ_nodes: list[dict[str, Any]] = field(default_factory=list)
    """Per tensor occurrence in walk order: the tensor and its tree node (for :class:`Layout`)."""
    reusable: bool = True
    """Whether this encode's layout may be replayed (no sharded or conjugate-view tensors)."""

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        if self.replay is not None:
            raise _Miss  # a tensor subclass (DTensor, ...): not replayed
        if placement.is_dtensor(t) or (
            self.world_size > 1 and self.replicated is not None and self.replicated(path)
        ):
            self.reusable = False
            return self._sharded(t, path)
        idx = self.by_tensor.get(id(t))
        if idx is None:
            hit = self.cache.old.get(id(t)) if self.cache is not None else None
            if hit is not None and hit.matches(t):
                idx = self._reuse(t, hit)
            else:
                idx = self._add_tensor(t, path)
            self.by_tensor[id(t)] = idx
            self.keep_alive.append(t)  # ids stay unique while encoding
        node: dict[str, Any] = {TENSOR_TAG: idx}
        # type(), not isinstance(): Parameter's metaclass makes isinstance cost microseconds,
        # and _add_tensor admits no other subclass.
        if type(t) is torch.nn.Parameter:
            node["param"] = True
        self.occ_tensors.append(t)
        self.occ_nodes.append(node)
        return node

    def _sharded(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        """A DTensor or declared-replicated tensor: this rank's chunk, written only by its owner."""
        idx = self.by_sharded.get(id(t))
        if idx is None:
            if placement.is_dtensor(t):
                layout = placement.dtensor_layout(t, self.rank, path)
            else:
                layout = placement.replicated_layout(t, self.world_size)
            owner = self.owners.owners(layout).get(layout.region, self.rank)
            tidx = None
            if owner == self.rank and placement.region_numel(layout.region[1]) > 0:
                local = layout.local.detach()
                tidx = self._add_tensor(local, path)
                self.keep_alive.append(local)
            idx = len(self.sharded)
            self.sharded.append(
                ShardedEntry(
                    path=path,
                    dtype=dtype_name(t.dtype),
                    global_shape=list(layout.global_shape),
                    offsets=list(layout.region[0]),
                    lengths=list(layout.region[1]),
                    owner=owner,
                    tensor=tidx,
                    mesh=layout.mesh,
                    mesh_shape=layout.mesh_shape,
                    placements=layout.placements,
                    param=isinstance(t, torch.nn.Parameter),
                    requires_grad=t.requires_grad,
                )
            )
            self.by_sharded[id(t)] = idx
            # not keep_alive: that lists plain tensors whose storages the save path inspects
            self.sharded_alive.append(t)
        return {placement.SHARDED_TAG: idx}

    def _add_tensor(self, t: torch.Tensor, path: str) -> int:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"cannot checkpoint {path}: tensor subclass {type(t).__qualname__} is not "
                "supported; convert it to a plain tensor (e.g. DTensor.to_local())"
            )
        if t.layout != torch.strided:
            raise TypeError(
                f"cannot checkpoint {path}: {t.layout} tensors are not supported; "
                "convert it with .to_dense()"
            )
        if t.is_quantized:
            raise TypeError(
                f"cannot checkpoint {path}: quantized tensors are not supported; "
                "store .int_repr() with its scale and zero point"
            )
        if t.is_meta:
            raise TypeError(f"cannot checkpoint {path}: a meta tensor holds no data")
        live = t
        resolved = t.is_conj() or t.is_neg()
        if resolved:
            t = t.resolve_conj().resolve_neg()
            self.keep_alive.append(t)
            self.reusable = False
        st = t.untyped_storage()
        key = st._cdata
        sidx = self.by_storage.get(key)
        if sidx is None:
            offset = -(-self.nbytes // ALIGN) * ALIGN
            n = st.nbytes()
            sidx = len(self.storages)
            # model_construct: the values come from torch itself; validation per entry would
            # cost more than copying a small tensor (W3: 10,000 tensors of 16 KB).
            self.storages.append(StorageEntry.model_construct(offset=offset, nbytes=n))
            src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            self.sources.append(src)
            self.by_storage[key] = sidx
            self.nbytes = offset + n
        entry = TensorEntry.model_construct(
            storage=sidx,
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            stride=list(t.stride()),
            storage_offset=int(t.storage_offset()),
            requires_grad=t.requires_grad,
        )
        self.tensors.append(entry)
        if self.cache is not None and not resolved:
            self.cache.new[id(live)] = _Cached(
                live,
                live.data_ptr(),
                live.shape,
                live.stride(),
                live.dtype,
                live.requires_grad,
                key,
                self.storages[sidx],
                self.sources[sidx],
                entry,
            )
        return len(self.tensors) - 1

    def _reuse(self, t: torch.Tensor, hit: _Cached) -> int:
        """A tensor encoded by the previous save, unchanged in layout: no torch or pydantic
        calls, the entries are reused when their place in the data object is the same."""
        sidx = self.by_storage.get(hit.storage_key)
        if sidx is None:
            offset = -(-self.nbytes // ALIGN) * ALIGN
            se = hit.storage
            if se.offset != offset:
                se = StorageEntry.model_construct(offset=offset, nbytes=se.nbytes)
            sidx = len(self.storages)
            self.storages.append(se)
            self.sources.append(hit.source)
            self.by_storage[hit.storage_key] = sidx
            self.nbytes = offset + se.nbytes
        te = hit.entry
        if te.storage != sidx:
            te = te.model_copy(update={"storage": sidx})
        self.tensors.append(te)
        assert self.cache is not None
        if te is hit.entry and self.storages[sidx] is hit.storage:
            self.cache.new[id(t)] = hit
            return len(self.tensors) - 1
        self.cache.new[id(t)] = _Cached(
            t,
            hit.ptr,
            hit.shape,
            hit.stride,
            hit.dtype,
            hit.requires_grad,
            hit.storage_key,
            self.storages[sidx],
            hit.source,
            te,
        )
        return len(self.tensors) - 1

    def node(self, obj: Any, path: str) -> Any:
        if self.replay is not None and type(obj) in _PLAIN_TENSORS:
            return self.replayed(obj)
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        np = np_module()
        if np is not None and isinstance(obj, np.generic):
            return self._np_scalar(obj, path)
        if np is not None and isinstance(obj, np.ndarray):
            return {"__ndarray__": self._np_array(obj, path)}
        if isinstance(obj, int):
            if INT64_MIN <= obj <= INT64_MAX:
                return int(obj)
            return {"__int__": str(int(obj))}
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {"__float__": repr(float(obj))}
        if isinstance(obj, complex):
            return {"__complex__": [self.node(obj.real, path), self.node(obj.imag, path)]}
        if isinstance(obj, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": dtype_name(obj)}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, (list, tuple, set, frozenset, dict)):
            if id(obj) in self.on_path:
                raise TypeError(f"cannot checkpoint {path}: it contains itself (a cycle)")
            self.on_path.add(id(obj))
            try:
                return self._container(obj, path)
            finally:
                self.on_path.discard(id(obj))
        if is_stateful(obj):
            return self.node(obj.state_dict(), path)
        raise TypeError(
            f"cannot checkpoint {path}: {type(obj).__module__}.{type(obj).__qualname__} is not a "
            "supported type. Strata stores tensors, numbers, str, bytes, None, lists, tuples, "
            "dicts and sets of these, numpy arrays and scalars, torch dtype/Size/device, and "
            "objects with state_dict()/load_state_dict(); nothing is pickled. Convert it to one "
            "of these (e.g. a tensor, a dict of plain values, or its state_dict())."
        )

    def _container(self, obj: Any, path: str) -> Any:
        if self.replay is not None and type(obj) is list:
            return self.shared(obj, self._replayed_values(obj))
        if isinstance(obj, list):
            return [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"__tuple__": [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            tag = "__frozenset__" if isinstance(obj, frozenset) else "__set__"
            return {tag: [self.node(v, f"{path}{{...}}") for v in obj]}
        meta = getattr(obj, "_metadata", None)
        plain = type(obj) is dict and meta is None and _plain_keys(obj)
        if plain:
            if self.replay is not None:
                return self.shared(obj, self._replayed_values(obj.values()))
            return {k: self.node(v, f"{path}{key_str(k)}") for k, v in obj.items()}
        replay = self.replay is not None
        out: dict[str, Any] = {
            "__dict__": [
                [
                    self.node(k, "" if replay else f"{path}<key {k!r}>"),
                    self.node(v, "" if replay else f"{path}{key_str(k)}"),
                ]
                for k, v in obj.items()
            ]
        }
        if isinstance(obj, collections.OrderedDict):
            out["type"] = "OrderedDict"
        elif type(obj) is not dict:
            # defaultdict, custom Mapping subclasses: restored as a plain dict.
            out["type"] = "dict"
        if meta is not None:
            out["metadata"] = self.node(meta, f"{path}._metadata")
        return out

    def _np_array(self, arr: Any, path: str) -> dict[str, Any]:
        if arr.dtype.kind in "OV":
            raise TypeError(
                f"cannot checkpoint {path}: numpy arrays of dtype {arr.dtype} (objects or "
                "structured records) are not supported; convert it to numeric arrays or lists"
            )
        np = np_module()
        return {
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "data": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode(),
        }

    def _np_scalar(self, x: Any, path: str) -> dict[str, Any]:
        if x.dtype.kind in "OV":
            raise TypeError(f"cannot checkpoint {path}: numpy scalar of dtype {x.dtype}")
        return {
            "__npscalar__": {"dtype": x.dtype.str, "data": base64.b64encode(x.tobytes()).decode()}
        }


def _plain_keys(d: dict[Any, Any]) -> bool:
    """Every key is a str not starting with ``__`` (the loops run in C: ~0.1 us a key)."""
    return all(map(isinstance, d, itertools.repeat(str))) and not any(
        map(str.startswith, d, itertools.repeat("__"))
    )


def encode(
    state: Any,
    root: str = "state",
    cache: EncodeCache | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    replicated: bool | Collection[str] | None = None,
) -> EncodedState:
    """Split ``state`` into JSON and storages (nothing is copied yet; see :func:`write_data`).

    ``rank``/``world_size``: this rank's identity, for DTensors and for the tensors declared
    ``replicated`` (:func:`strata.format.placement.replicated_rule`): each rank keeps only its
    local chunk, and a chunk held by several ranks is stored only by its owner
    (:mod:`strata.format.placement`).
    Raises ``TypeError`` naming the path (``root[...]...``) of the first unsupported value.
    The returned sources alias the live tensors: copy them (:func:`write_data`) before the
    training loop mutates them. ``cache``: see :class:`EncodeCache`.
    """
    rule = placement.replicated_rule(replicated, root)
    params = (root, rank, world_size)
    if cache is not None and (rule is None or world_size == 1):
        lay = cache.layout
        if lay is not None and lay.params == params:
            replayed = _replay(state, root, lay, cache)
            if replayed is not None:
                return replayed
    enc = _Encoder(cache=cache, rank=rank, world_size=world_size, replicated=rule)
    if cache is not None:
        cache.new = {}
        cache.layout = None
    try:
        tree = enc.node(state, root)
    finally:
        if cache is not None:
            cache.old, cache.new = cache.new, {}
    layout = None
    if cache is not None and enc.reusable and (rule is None or world_size == 1):
        layout = Layout.build(
            params,
            enc.tensors,
            enc.storages,
            enc.sources,
            enc.keep_alive,
            enc.nbytes,
            enc.occ_tensors,
            enc.occ_nodes,
            set(enc.by_storage),
        )
        cache.layout = layout
    return EncodedState(
        tree=tree,
        tensors=enc.tensors,
        storages=enc.storages,
        sources=enc.sources,
        data_nbytes=enc.nbytes,
        live=enc.keep_alive,
        sharded=enc.sharded,
        layout=layout,
    )


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _replay(state: Any, root: str, lay: Layout, cache: EncodeCache) -> EncodedState | None:
    """Encode ``state`` against the previous save's layout ``lay``; None when it does not have
    that layout (or anything in it fails to encode: the full encode then says what and where).
    On success the cache's layout is updated (new tensor objects in place of old ones)."""
    enc = _Encoder()
    enc.replay = lay
    try:
        tree = enc.node(state, root)
        if enc.cursor != len(lay.occ_tensors):
            raise _Miss
    except Exception:  # _Miss, or an error the full encode will raise with its path
        return None
    if enc.fresh:
        for j, *_ in enc.fresh:
            # Forget the replaced tensors (their memory) and their per-tensor entries.
            cache.old.pop(id(lay.occ_tensors[j]), None)
        lay = lay.replaced(enc.fresh)
        cache.layout = lay
    lay.containers = enc.containers
    cache.layout_hits += 1
    return EncodedState(
        tree=tree,
        tensors=lay.tensors,
        storages=lay.storages,
        sources=lay.sources,
        data_nbytes=lay.data_nbytes,
        live=lay.live,
        layout=lay,
    )


def dumps(state: Any) -> tuple[EncodedState, bytearray]:
    """Encode ``state`` and copy its storages into a new bytearray (tests, small states)."""
    enc = encode(state)
    data = bytearray(enc.data_nbytes)
    write_data(enc, data)
    return enc, data
