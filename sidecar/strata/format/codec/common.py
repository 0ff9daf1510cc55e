"""What the codec's encoder and decoder share: the tag helpers and the types of its seams.

torch only; no manifest I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from strata.errors import CodecError
from strata.format.encode_cache import TENSOR_TAG
from strata.format.manifest import ShardedEntry, StorageEntry, TensorEntry

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "TENSOR_TAG",
    "CheckedEntry",
    "Resolver",
    "TensorSink",
    "dtype_from_name",
    "dtype_name",
    "is_stateful",
    "itemsize",
    "key_str",
    "np_module",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Ints outside this range are stored as ``{"__int__": "<decimal>"}``."""

TensorSink = Callable[[TensorEntry, StorageEntry, torch.Tensor], bool]
"""See :func:`strata.format.codec.load_into`."""
CheckedEntry = tuple[TensorEntry, StorageEntry, torch.dtype]
"""A tensor entry checked against its storage and the data object, its storage, its dtype."""
Resolver = Callable[[ShardedEntry, Any, "torch.Tensor | None", str], Any]
"""Loads a sharded tensor: ``(entry, live value, this shard's chunk view or None, path)`` ->
the value to put in the tree (the live tensor once filled, or a promise to fill it)."""


def np_module() -> Any:
    """numpy, or None where it is not installed."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with the torch extra
        return None
    return numpy


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'`` (the manifest's spelling)."""
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


def key_str(key: Any) -> str:
    """A dict key as it appears in a path (``state['optim'][3]``)."""
    return f"[{key!r}]"


def is_stateful(obj: Any) -> bool:
    """An object restored through its ``state_dict()`` / ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def itemsize(dt: torch.dtype) -> int:
    return int(dt.itemsize)
