"""Decoding against a data object: new tensors over (or cloned from) the shard's bytes.

:func:`load` is the pure load (new CPU tensors, storages shared as saved); loading into live
state is :mod:`strata.format.codec.into`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from strata.errors import CodecError
from strata.format.codec.common import CheckedEntry, Resolver, TensorSink, itemsize
from strata.format.codec.tree import TreeReader
from strata.format.datacopy import Buffer
from strata.format.datacopy import as_uint8 as _as_uint8
from strata.format.manifest import Manifest


class Decoder(TreeReader):
    """Decodes one manifest's tree against one data buffer."""

    def __init__(
        self,
        manifest: Manifest,
        data: Buffer | bytes | torch.Tensor,
        where: str,
        resolve: Resolver | None = None,
        checked: dict[int, CheckedEntry] | None = None,
    ) -> None:
        super().__init__(manifest, where, checked)
        self.resolve = resolve
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
        self.sink: TensorSink | None = None
        self.flush: Callable[[], None] | None = None

    def view(self, idx: int) -> torch.Tensor:
        """A tensor over the data buffer itself (zero copy; valid while the buffer lives)."""
        te, se, dt = self.check_entry(idx)
        size = itemsize(dt)
        if se.offset % size:
            raise CodecError(f"{self.where}: storage {te.storage} is misaligned for {te.dtype}")
        base = self.buf.untyped_storage()
        start = int(self.buf.storage_offset()) + se.offset
        return _set(dt, base, start // size + te.storage_offset, te.shape, te.stride)

    def new(self, idx: int, param: bool) -> torch.Tensor:
        """A new CPU tensor; tensors of one storage share one new storage, as saved."""
        cached = self._new.get(idx)
        if cached is not None:
            return cached
        te, se, dt = self.check_entry(idx)
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
    dec = Decoder(manifest, data, where)
    return dec.value(manifest.tree, "state")
