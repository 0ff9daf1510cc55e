"""Reading a manifest's tree: tagged JSON -> values, and the checks of its tensor entries.

:class:`TreeReader` decodes every tag of :mod:`strata.format.codec`'s table except the tensor
data itself (:meth:`TreeReader.new` is the hook :class:`strata.format.codec.decode.Decoder`
fills); the fit check (:mod:`strata.format.codec.fit`) reads trees with it alone, without a data
object.
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Mapping
from typing import Any

import torch

from strata.errors import CodecError
from strata.format import placement
from strata.format.codec.common import (
    TENSOR_TAG,
    CheckedEntry,
    dtype_from_name,
    itemsize,
    key_str,
    np_module,
)
from strata.format.manifest import Manifest, ShardedEntry


class TreeReader:
    """Decodes one manifest's tree (``where`` names it in errors). ``checked``: a cache of
    checked tensor entries to share (the fit check fills the loading decoder's)."""

    def __init__(
        self, manifest: Manifest, where: str, checked: dict[int, CheckedEntry] | None = None
    ) -> None:
        self.m = manifest
        self.where = where
        self._np = np_module()
        self.checked: dict[int, CheckedEntry] = {} if checked is None else checked
        """Tensor entries already checked by :meth:`check_entry`, by index."""

    # tensors -----------------------------------------------------------------------------------
    def check_entry(self, idx: int) -> CheckedEntry:
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
        size = itemsize(dt)
        if any(s == 0 for s in te.shape):
            extent = 0
        else:
            extent = (
                te.storage_offset
                + 1
                + sum((n - 1) * s for n, s in zip(te.shape, te.stride, strict=True))
            ) * size
        if extent > se.nbytes or any(s < 0 for s in te.stride):
            raise CodecError(
                f"{self.where}: tensor {idx} ({te.dtype}{te.shape}, stride {te.stride}, offset "
                f"{te.storage_offset}) does not fit its {se.nbytes}-byte storage"
            )
        return te, se, dt

    def new(self, idx: int, param: bool) -> torch.Tensor:
        """The tensor of entry ``idx`` (a Parameter when ``param``); a reader without a data
        object has none: :class:`CodecError`."""
        raise CodecError(f"{self.where}: tensor {idx} read without its data object")

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
            return {k: self.value(v, f"{path}{key_str(k)}") for k, v in node.items()}
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
            items.append((k, self.value(v_node, f"{path}{key_str(k)}")))
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
