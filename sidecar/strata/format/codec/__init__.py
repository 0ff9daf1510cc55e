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

Layout of this package (a format reader finds each half by name): :mod:`~.common` (the tag
helpers and seam types both halves share), :mod:`~.encode` (state -> tree + storages),
:mod:`~.tree` (tree -> values, entry checks), :mod:`~.decode` (against a data object: new
tensors, :func:`load`), :mod:`~.fit` (does a checkpoint fit the live state?) and :mod:`~.into`
(:func:`load_into`). Every tag of the table is written in :mod:`~.encode` and read in
:mod:`~.tree`; ``tests/unit/test_codec.py`` round-trips each one, which is what keeps the pair
symmetric. Imports go one way (``into`` -> ``fit``/``decode`` -> ``tree`` -> ``common``;
``encode`` -> ``common``; an import contract holds it). What is not a tag lives elsewhere: the
copy of the storages (:mod:`strata.format.datacopy`) and the reuse of the previous save's layout
(:mod:`strata.format.encode_cache`: with a cache, an encode whose tensors are the previous
save's, in the same order and layout, reuses its entries, offsets, manifest JSON and copy plan).
"""

from __future__ import annotations

from strata.errors import CodecError
from strata.format.codec.common import (
    TENSOR_TAG,
    CheckedEntry,
    Resolver,
    TensorSink,
    dtype_from_name,
)
from strata.format.codec.decode import load
from strata.format.codec.encode import EncodedState, dumps, encode
from strata.format.codec.into import load_into
from strata.format.datacopy import Buffer, write_data

__all__ = [
    "TENSOR_TAG",
    "Buffer",
    "CheckedEntry",
    "CodecError",
    "EncodedState",
    "Resolver",
    "TensorSink",
    "dtype_from_name",
    "dumps",
    "encode",
    "load",
    "load_into",
    "write_data",
]
