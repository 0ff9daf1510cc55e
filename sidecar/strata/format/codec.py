"""State tree <-> (manifest tree, tensor views, storages) + data bytes. No pickle.

Encoding (``encode``) walks a training state tree (dicts, lists, tuples, tensors, numbers, RNG
states, ``state_dict()`` of modules/optimizers ...) and returns an :class:`EncodedState`:

- every tensor is recorded the way ``torch.save`` does it, by its *untyped storage*: tied weights
  and views keep sharing one storage, and a non-contiguous view restores with its strides and
  storage offset. Storages are laid out back to back in the data object, each aligned to
  :data:`strata.format.manifest.ALIGN` bytes; :func:`write_data` copies them (several threads);
- every other value becomes tagged JSON (the manifest's ``tree``); a tensor becomes
  ``{"__tensor__": index}`` into ``Manifest.tensors``.

Tagged JSON (any JSON object whose first key starts with ``__`` is a tag; a user dict with such a
key, or with non-str keys, is stored as ``{"__dict__": [[key, value], ...]}``):

========================  ==================================================================
Python value              JSON
========================  ==================================================================
None, bool, str, int      themselves (ints outside int64: ``{"__int__": "<decimal>"}``)
float                     itself; nan/inf/-inf: ``{"__float__": "nan"}`` (exact round trip)
list                      a list
tuple / set / frozenset   ``{"__tuple__": [...]}`` / ``{"__set__": [...]}`` / ``{"__frozenset__"}``
dict (str keys)           an object; OrderedDict (and ``state_dict()._metadata``) via ``__dict__``
bytes / bytearray         ``{"__bytes__": "<base64>"}``
complex                   ``{"__complex__": [re, im]}``
torch dtype/Size/device   ``{"__dtype__": "bfloat16"}``, ``{"__size__": [2, 3]}``, ``{"__device__"}``
numpy ndarray / scalar    ``{"__ndarray__": {"dtype", "shape", "data": base64}}`` / ``__npscalar__``
DTensor / replicated      ``{"__sharded__": i}`` into ``Manifest.sharded`` (strata.format.placement)
``state_dict()`` owner    its ``state_dict()`` (nn.Module, Optimizer, LR scheduler, ...)
========================  ==================================================================

So python ``random.getstate()`` (a tuple of ints), numpy RNG states (the legacy tuple with a
uint32 array, and ``Generator.bit_generator.state`` dicts with 128-bit ints), torch RNG states
(uint8 tensors) and optimizer ``state_dict()`` (int keys, ``param_groups``) round-trip exactly.
numpy arrays are stored inline (base64) in the manifest: convert big arrays to tensors.

Anything else raises ``TypeError`` naming its path in the tree (``state['optim']['state'][3]``)
and what to convert it to.

Loading: :func:`load` builds new tensors (CPU; storages shared as saved, Parameters as
Parameters). :func:`load_into` copies saved tensors *in place* into the live state (so
``model.parameters()`` keep their identity), refills live dicts/lists in place, calls
``load_state_dict`` of live ``state_dict()`` owners, and returns the loaded tree.

Limits: tensors on non-CPU devices are copied to the CPU data object and loaded into live tensors
on any device; DTensors (and tensors declared replicated) become ``{"__sharded__": i}`` nodes:
this rank's chunk plus its global placement (:mod:`strata.format.placement`); sparse, quantized,
meta and other tensor-subclass tensors are refused with a TypeError saying what to convert them to; conjugate/negative-bit views are resolved first (they
no longer share storage after a restore).

Size (about 900 lines): encoding and decoding are kept in one module on purpose: every tag above
is written in one place and read in another, and keeping the pair side by side is what keeps
them symmetric; splitting would separate each writer from its reader. What is not a tag lives
elsewhere: the copy of the storages (:mod:`strata.format.datacopy`) and the reuse of the
previous save's layout (:mod:`strata.format.encode_cache`: with a cache, an encode whose tensors
are the previous save's, in the same order and layout, reuses its entries, offsets, manifest
JSON and copy plan; issue 14, many small tensors).
"""

from __future__ import annotations

import base64
import collections
import itertools
import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.errors import CodecError
from strata.format import placement
from strata.format.datacopy import Buffer, write_data
from strata.format.datacopy import as_uint8 as _as_uint8
from strata.format.encode_cache import TENSOR_TAG, EncodeCache, Layout, Replayer, _Cached, _Miss
from strata.format.manifest import (
    ALIGN,
    DEFAULT_CHUNK_SIZE,
    Manifest,
    ShardedEntry,
    StorageEntry,
    TensorEntry,
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

__all__ = [
    "TENSOR_TAG",
    "Buffer",
    "EncodedState",
    "dumps",
    "encode",
    "load",
    "load_into",
    "write_data",
]
TensorSink = Callable[[TensorEntry, StorageEntry, torch.Tensor], bool]
"""See :func:`load_into`."""
CheckedEntry = tuple[TensorEntry, StorageEntry, torch.dtype]
"""A tensor entry checked against its storage and the data object, its storage, its dtype."""


def _np() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with the torch extra
        return None
    return numpy


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str = "manifest") -> torch.dtype:
    """``'bfloat16'`` -> ``torch.bfloat16``; CodecError for names this torch does not know."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CodecError(
            f"{where}: dtype {name!r} is unknown to torch {torch.__version__}; "
            "restore with the torch version that wrote the checkpoint"
        )
    return dt


def _key_str(key: Any) -> str:
    return f"[{key!r}]"


# ----------------------------------------------------------------------------------------- encode


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
                    dtype=_dtype_name(t.dtype),
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
            dtype=_dtype_name(t.dtype),
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
        np = _np()
        if np is not None and isinstance(obj, np.generic):
            return self._np_scalar(obj, path)
        if np is not None and isinstance(obj, np.ndarray):
            return {"__ndarray__": self._np_array(obj, path)}
        if isinstance(obj, int):
            if _INT64_MIN <= obj <= _INT64_MAX:
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
            return {"__dtype__": _dtype_name(obj)}
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
        if _is_stateful(obj):
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
            return {k: self.node(v, f"{path}{_key_str(k)}") for k, v in obj.items()}
        replay = self.replay is not None
        out: dict[str, Any] = {
            "__dict__": [
                [
                    self.node(k, "" if replay else f"{path}<key {k!r}>"),
                    self.node(v, "" if replay else f"{path}{_key_str(k)}"),
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
        np = _np()
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


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
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


# ----------------------------------------------------------------------------------------- decode


class _Decoder:
    """Decodes one manifest's tree against one data buffer."""

    def __init__(
        self,
        manifest: Manifest,
        data: Buffer | bytes | torch.Tensor,
        where: str,
        resolve: Resolver | None = None,
    ) -> None:
        self.m = manifest
        self.resolve = resolve
        self.where = where
        if isinstance(data, bytes):
            data = bytearray(data)
        self.buf = _as_uint8(data)
        if self.buf.numel() < manifest.data_nbytes:
            raise CodecError(
                f"{where}: data holds {self.buf.numel()} bytes, the manifest records "
                f"{manifest.data_nbytes} (truncated shard; restore another step or tier)"
            )
        self._owned: dict[int, torch.UntypedStorage] = {}
        self._new: dict[int, torch.Tensor] = {}
        self._np = _np()
        self.sink: TensorSink | None = None
        self.flush: Callable[[], None] | None = None
        self.checked: dict[int, CheckedEntry] = {}
        """Tensor entries already checked by :meth:`_check_entry`, by index."""

    # tensors -----------------------------------------------------------------------------------
    def _check_entry(self, idx: int) -> CheckedEntry:
        """Tensor entry ``idx``, its storage entry and dtype, checked to lie inside the data
        object (once per entry: the fit check and the load share :attr:`checked`). Raises
        :class:`CodecError`."""
        hit = self.checked.get(idx)
        if hit is not None:
            return hit
        out = self._check_entry_once(idx)
        self.checked[idx] = out
        return out

    def _check_entry_once(self, idx: int) -> CheckedEntry:
        if not 0 <= idx < len(self.m.tensors):
            raise CodecError(
                f"{self.where}: tree refers to tensor {idx}, manifest has {len(self.m.tensors)}"
            )
        te = self.m.tensors[idx]
        if te.storage >= len(self.m.storages):
            raise CodecError(f"{self.where}: tensor {idx} refers to missing storage {te.storage}")
        se = self.m.storages[te.storage]
        if se.offset + se.nbytes > self.m.data_nbytes:
            raise CodecError(f"{self.where}: storage {te.storage} lies beyond the data object")
        dt = dtype_from_name(te.dtype, self.where)
        if len(te.shape) != len(te.stride):
            raise CodecError(
                f"{self.where}: tensor {idx} has shape {te.shape} but stride {te.stride}"
            )
        itemsize = _itemsize(dt)
        if any(s == 0 for s in te.shape):
            extent = 0
        else:
            extent = (
                te.storage_offset
                + 1
                + sum((n - 1) * s for n, s in zip(te.shape, te.stride, strict=True))
            ) * itemsize
        if extent > se.nbytes or any(s < 0 for s in te.stride):
            raise CodecError(
                f"{self.where}: tensor {idx} ({te.dtype}{te.shape}, stride {te.stride}, offset "
                f"{te.storage_offset}) does not fit its {se.nbytes}-byte storage"
            )
        return te, se, dt

    def view(self, idx: int) -> torch.Tensor:
        """A tensor over the data buffer itself (zero copy; valid while the buffer lives)."""
        te, se, dt = self._check_entry(idx)
        itemsize = _itemsize(dt)
        if se.offset % itemsize:
            raise CodecError(f"{self.where}: storage {te.storage} is misaligned for {te.dtype}")
        base = self.buf.untyped_storage()
        start = int(self.buf.storage_offset()) + se.offset
        return _set(dt, base, start // itemsize + te.storage_offset, te.shape, te.stride)

    def new(self, idx: int, param: bool) -> torch.Tensor:
        """A new CPU tensor; tensors of one storage share one new storage, as saved."""
        cached = self._new.get(idx)
        if cached is not None:
            return cached
        te, se, dt = self._check_entry(idx)
        st = self._owned.get(te.storage)
        if st is None:
            st = self.buf[se.offset : se.offset + se.nbytes].clone().untyped_storage()
            self._owned[te.storage] = st
        t = _set(dt, st, te.storage_offset, te.shape, te.stride)
        if param:
            t = torch.nn.Parameter(t, requires_grad=te.requires_grad)
        elif te.requires_grad and (dt.is_floating_point or dt.is_complex):
            t.requires_grad_(True)
        self._new[idx] = t
        return t

    def sharded_entry(self, idx: int) -> ShardedEntry:
        if not 0 <= idx < len(self.m.sharded):
            raise CodecError(
                f"{self.where}: tree refers to sharded tensor {idx}, manifest has "
                f"{len(self.m.sharded)}"
            )
        return self.m.sharded[idx]

    # tree --------------------------------------------------------------------------------------
    def value(self, node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.value(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            raise CodecError(f"{self.where}: unexpected JSON {type(node).__name__} at {path}")
        tag = next(iter(node), None)
        if tag is None or not tag.startswith("__"):
            return {k: self.value(v, f"{path}{_key_str(k)}") for k, v in node.items()}
        arg = node[tag]
        try:
            if tag == TENSOR_TAG:
                return self.new(int(arg), bool(node.get("param")))
            if tag == placement.SHARDED_TAG:
                entry = self.sharded_entry(int(arg))
                if entry.tensor is None:
                    return None
                return self.new(entry.tensor, entry.param)
            if tag == "__float__":
                return float(arg)
            if tag == "__int__":
                return int(arg)
            if tag == "__tuple__":
                return tuple(self.value(v, f"{path}[{i}]") for i, v in enumerate(arg))
            if tag == "__set__":
                return {self.value(v, path) for v in arg}
            if tag == "__frozenset__":
                return frozenset(self.value(v, path) for v in arg)
            if tag == "__dict__":
                return self._dict(node, path)
            if tag == "__bytes__":
                return base64.b64decode(arg)
            if tag == "__complex__":
                return complex(self.value(arg[0], path), self.value(arg[1], path))
            if tag == "__dtype__":
                return dtype_from_name(arg, f"{self.where} at {path}")
            if tag == "__size__":
                return torch.Size(int(v) for v in arg)
            if tag == "__device__":
                return torch.device(arg)
            if tag == "__ndarray__":
                return self._ndarray(arg)
            if tag == "__npscalar__":
                return self._np.frombuffer(
                    base64.b64decode(arg["data"]), dtype=self._np.dtype(arg["dtype"])
                )[0]
        except CodecError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise CodecError(f"{self.where}: malformed {tag} node at {path}: {exc}") from None
        raise CodecError(
            f"{self.where}: unknown tag {tag!r} at {path}; written by a newer Strata? "
            "Restore with that version"
        )

    def _dict(self, node: Mapping[str, Any], path: str) -> dict[Any, Any]:
        items = []
        for k_node, v_node in node["__dict__"]:
            k = self.value(k_node, path)
            items.append((k, self.value(v_node, f"{path}{_key_str(k)}")))
        out: dict[Any, Any] = (
            collections.OrderedDict(items) if node.get("type") == "OrderedDict" else dict(items)
        )
        if "metadata" in node:
            out._metadata = self.value(node["metadata"], f"{path}._metadata")  # type: ignore[attr-defined]
        return out

    def _ndarray(self, arg: Mapping[str, Any]) -> Any:
        np = self._np
        arr = np.frombuffer(base64.b64decode(arg["data"]), dtype=np.dtype(arg["dtype"]))
        return arr.reshape([int(s) for s in arg["shape"]]).copy()


def _itemsize(dt: torch.dtype) -> int:
    return int(dt.itemsize)


def _set(
    dt: torch.dtype,
    st: torch.UntypedStorage,
    offset: int,
    shape: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    with warnings.catch_warnings():
        # complex32 / bcomplex32 tensors warn "experimental" on creation; the user chose them.
        warnings.filterwarnings(
            "ignore", message=".*support is experimental.*", category=UserWarning
        )
        return torch.empty(0, dtype=dt).set_(st, offset, list(shape), list(stride))


def load(manifest: Manifest, data: Buffer | bytes | torch.Tensor, where: str = "shard") -> Any:
    """The saved state tree with new CPU tensors (storages shared as saved). Pure.

    ``data``: the shard's data object (at least ``manifest.data_nbytes`` bytes; an mmap must be
    writable or MAP_PRIVATE: torch refuses read-only buffers). Raises :class:`CodecError`
    naming ``where`` for a manifest that does not fit its data.
    """
    dec = _Decoder(manifest, data, where)
    return dec.value(manifest.tree, "state")


Resolver = Callable[[ShardedEntry, Any, "torch.Tensor | None", str], Any]
"""Loads a sharded tensor: ``(entry, live value, this shard's chunk view or None, path)`` ->
the value to put in the tree (the live tensor once filled, or a promise to fill it)."""


def load_into(
    state: Any,
    manifest: Manifest,
    data: Buffer | bytes | torch.Tensor,
    where: str = "shard",
    *,
    sink: TensorSink | None = None,
    flush: Callable[[], None] | None = None,
    resolve: Resolver | None = None,
) -> Any:
    """Load the saved tree into the live ``state`` in place; return the loaded tree.

    ``sink(tensor_entry, storage_entry, live)``: offered every saved tensor whose live
    counterpart has its dtype and shape (entries validated against the data); True means the
    sink copies it (later, e.g. in one parallel pass: :mod:`strata.client.loader`) and the codec
    does not. ``flush()``: called before each live ``load_state_dict`` and must finish the
    sink's pending copies.

    - A saved tensor whose live counterpart (same path) is a tensor is copied into it in place
      (``torch.no_grad``; any device); dtype or shape differences raise :class:`CodecError`
      naming the path (the model does not match the checkpoint).
    - A live dict / list is refilled in place with the saved keys / items.
    - A live object with ``load_state_dict`` gets ``load_state_dict(<loaded state_dict>)``.
    - Anything else (or a missing live counterpart) is taken from the checkpoint (new tensors).

    - A sharded tensor (``{"__sharded__": i}``, :mod:`strata.format.placement`) goes to
      ``resolve`` (the client's resharding restore, :mod:`strata.client.sharded`); without one
      it loads as this shard's chunk (None where another rank stored the bytes).

    The returned tree holds the live objects where they were updated in place. The whole tree
    is checked against the live state first (:func:`strata.format.fit.check_fits`): a
    mismatch raises one :class:`CodecError` naming the paths, and nothing is written.
    """
    from strata.format.fit import check_fits

    dec = _Decoder(manifest, data, where, resolve)
    check_fits(state, manifest, where, checked=dec.checked)
    dec.sink, dec.flush = sink, flush
    with torch.no_grad():
        return _into(dec, manifest.tree, state, "state")


def _into(dec: _Decoder, node: Any, live: Any, path: str) -> Any:
    if _is_stateful(live) and not isinstance(live, (dict, list, torch.Tensor)):
        loaded = _into(dec, node, live.state_dict(), path)
        if dec.flush is not None:
            dec.flush()
        live.load_state_dict(loaded)
        return live
    if isinstance(node, dict) and node:
        tag = next(iter(node))
        if tag == placement.SHARDED_TAG and dec.resolve is not None:
            entry = dec.sharded_entry(int(node[tag]))
            chunk = None if entry.tensor is None else dec.view(entry.tensor)
            return dec.resolve(entry, live, chunk, path)
        if tag == TENSOR_TAG and isinstance(live, torch.Tensor):
            idx = int(node[TENSOR_TAG])
            if dec.sink is not None:
                te, se, dt = dec._check_entry(idx)
                if dt == live.dtype and list(live.shape) == te.shape and dec.sink(te, se, live):
                    return live
            src = dec.view(idx)
            if src.dtype != live.dtype or src.shape != live.shape:
                raise CodecError(
                    f"{dec.where}: the checkpoint holds {_dtype_name(src.dtype)}{list(src.shape)} "
                    f"at {path} but the live tensor is {_dtype_name(live.dtype)}"
                    f"{list(live.shape)}: the model does not match the checkpoint (another "
                    "architecture or configuration?); build the same model or restore fresh"
                )
            live.copy_(src)
            return live
        if not tag.startswith("__") and isinstance(live, dict) and type(live) is dict:
            items = [
                (k, _into(dec, v, live.get(k), f"{path}{_key_str(k)}")) for k, v in node.items()
            ]
            live.clear()
            live.update(items)
            return live
        if tag == "__dict__" and isinstance(live, dict):
            items = []
            for k_node, v_node in node["__dict__"]:
                k = dec.value(k_node, path)
                items.append((k, _into(dec, v_node, live.get(k), f"{path}{_key_str(k)}")))
            live.clear()
            live.update(items)
            if "metadata" in node:
                live._metadata = dec.value(node["metadata"], f"{path}._metadata")  # type: ignore[attr-defined]
            return live
        if tag == "__tuple__" and isinstance(live, tuple) and len(live) == len(node[tag]):
            return tuple(
                _into(dec, v, lv, f"{path}[{i}]")
                for i, (v, lv) in enumerate(zip(node[tag], live, strict=True))
            )
    if isinstance(node, list) and isinstance(live, list):
        n = len(live)
        items = [
            _into(dec, v, live[i] if i < n else None, f"{path}[{i}]") for i, v in enumerate(node)
        ]
        live[:] = items
        return live
    return dec.value(node, path)
