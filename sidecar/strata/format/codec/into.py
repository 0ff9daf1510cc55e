"""Loading a checkpoint into the live state in place (:func:`load_into`).

The whole tree is checked against the live state first (:mod:`strata.format.codec.fit`), then
saved tensors are copied into their live counterparts, containers refilled in place and
``load_state_dict`` called on live ``state_dict()`` owners.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from strata.errors import CodecError
from strata.format import placement
from strata.format.codec.common import (
    TENSOR_TAG,
    Resolver,
    TensorSink,
    dtype_name,
    is_stateful,
    key_str,
)
from strata.format.codec.decode import Decoder
from strata.format.codec.fit import check_fits
from strata.format.datacopy import Buffer
from strata.format.manifest import Manifest

__all__ = ["load_into"]


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
    is checked against the live state first (:func:`strata.format.codec.fit.check_fits`): a
    mismatch raises one :class:`CodecError` naming the paths, and nothing is written.
    """
    dec = Decoder(manifest, data, where, resolve)
    check_fits(state, manifest, where, checked=dec.checked)
    dec.sink, dec.flush = sink, flush
    with torch.no_grad():
        return _into(dec, manifest.tree, state, "state")


def _into(dec: Decoder, node: Any, live: Any, path: str) -> Any:
    if is_stateful(live) and not isinstance(live, (dict, list, torch.Tensor)):
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
                te, se, dt = dec.check_entry(idx)
                if dt == live.dtype and list(live.shape) == te.shape and dec.sink(te, se, live):
                    return live
            src = dec.view(idx)
            if src.dtype != live.dtype or src.shape != live.shape:
                raise CodecError(
                    f"{dec.where}: the checkpoint holds {dtype_name(src.dtype)}{list(src.shape)} "
                    f"at {path} but the live tensor is {dtype_name(live.dtype)}"
                    f"{list(live.shape)}: the model does not match the checkpoint (another "
                    "architecture or configuration?); build the same model or restore fresh"
                )
            live.copy_(src)
            return live
        if not tag.startswith("__") and isinstance(live, dict) and type(live) is dict:
            items = [
                (k, _into(dec, v, live.get(k), f"{path}{key_str(k)}")) for k, v in node.items()
            ]
            live.clear()
            live.update(items)
            return live
        if tag == "__dict__" and isinstance(live, dict):
            items = []
            for k_node, v_node in node["__dict__"]:
                k = dec.value(k_node, path)
                items.append((k, _into(dec, v_node, live.get(k), f"{path}{key_str(k)}")))
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
