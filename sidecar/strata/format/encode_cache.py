"""The encoder's memory between saves of one state (:class:`EncodeCache`; used by
:func:`strata.format.codec.encode`). No I/O."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.format.manifest import StorageEntry, TensorEntry


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


class EncodeCache:
    """What :func:`encode` learnt about each tensor of the previous save (pass the same object
    to every save of one state): a tensor whose data pointer, shape, strides and dtype are
    unchanged reuses its manifest entries instead of re-reading them through torch (~20 us a
    tensor; half the stall of a 10,000-tensor state). It holds the tensors of the last save
    (and so their memory) until the next one."""

    def __init__(self) -> None:
        self.old: dict[int, _Cached] = {}
        self.new: dict[int, _Cached] = {}
