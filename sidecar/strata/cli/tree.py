"""``strata inspect``: the state tree of a step, read from its manifests only (no tensor bytes,
no torch): every leaf with its key path, and for tensors dtype, shape and size in bytes.

Key paths join dict keys and list indices with ``.`` (``model.layers.0.weight``,
``optim.state.3.exp_avg``); the same names :mod:`strata.cli.export` writes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from strata.format.manifest import Manifest

TENSOR_TAG = "__tensor__"
SHARDED_TAG = "__sharded__"
"""A sharded tensor: its global shape and this rank's chunk (``Manifest.sharded``);
``bytes`` counts what this rank stores (0 where another rank of its replica group does)."""
_SEQ_TAGS = ("__tuple__", "__set__", "__frozenset__")

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "complex32": 4,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _leaf_value(node: Any) -> tuple[str, Any]:
    """(type name, short JSON-able value) of a non-container tagged leaf."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return type(node).__name__, node
    tag = next(iter(node))
    arg = node[tag]
    kinds = {
        "__int__": ("int", arg),
        "__float__": ("float", arg),
        "__bytes__": ("bytes", f"{len(arg) * 3 // 4} bytes"),
        "__complex__": ("complex", arg),
        "__dtype__": ("dtype", arg),
        "__size__": ("Size", arg),
        "__device__": ("device", arg),
    }
    if tag in kinds:
        return kinds[tag]
    if tag == "__ndarray__":
        return "ndarray", f"{arg.get('dtype')} {arg.get('shape')}"
    if tag == "__npscalar__":
        return "numpy scalar", arg.get("dtype")
    return tag.strip("_"), None


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, leaf node) of every leaf of a manifest tree (tagged JSON)."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, join(path, i))
        return
    if not isinstance(node, dict):
        yield path, node
        return
    tag = next(iter(node), None)
    if tag is None:
        return
    if not tag.startswith("__"):
        for k, v in node.items():
            yield from walk(v, join(path, k))
    elif tag in _SEQ_TAGS:
        for i, v in enumerate(node[tag]):
            yield from walk(v, join(path, i))
    elif tag == "__dict__":
        for k_node, v in node[tag]:
            key = _leaf_value(k_node)[1]
            yield from walk(v, join(path, key))
    else:
        yield path, node


def leaves(m: Manifest) -> list[dict[str, Any]]:
    """Every leaf of rank ``m.rank``'s state: tensors with dtype/shape/bytes, others with
    their type and (short) value."""
    out = []
    for path, node in walk(m.tree):
        if isinstance(node, dict) and TENSOR_TAG in node:
            te = m.tensors[int(node[TENSOR_TAG])]
            numel = math.prod(te.shape)
            item = _ITEMSIZE.get(te.dtype)
            out.append(
                {
                    "rank": m.rank,
                    "key": path,
                    "type": "tensor",
                    "dtype": te.dtype,
                    "shape": list(te.shape),
                    "bytes": numel * item if item is not None else None,
                }
            )
        elif isinstance(node, dict) and SHARDED_TAG in node:
            entry = m.sharded[int(node[SHARDED_TAG])]
            item = _ITEMSIZE.get(entry.dtype)
            stored = entry.tensor is not None
            out.append(
                {
                    "rank": m.rank,
                    "key": path,
                    "type": "sharded",
                    "dtype": entry.dtype,
                    "shape": list(entry.global_shape),
                    "bytes": math.prod(entry.lengths) * item if stored and item else 0,
                    "chunk": {
                        "offsets": list(entry.offsets),
                        "lengths": list(entry.lengths),
                        "owner": entry.owner,
                    },
                }
            )
        else:
            kind, value = _leaf_value(node)
            out.append({"rank": m.rank, "key": path, "type": kind, "value": value})
    return out
