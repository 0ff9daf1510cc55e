"""Does a checkpoint fit the live state? Checked before anything is written into it.

:func:`check_fits` walks a manifest's tree alongside the live state the way
:func:`strata.format.codec.load_into` will, without reading the data object or changing
anything, and raises one :class:`CodecError` naming every path where they differ (a restore
is all or nothing). The rules:

- a live tensor needs a saved tensor of the same dtype and shape at its path;
- a non-empty live dict needs exactly the saved keys (an empty one is filled, e.g. an
  optimizer's ``state`` before its first step; an empty saved one empties it, e.g. a checkpoint
  taken before the optimizer's first step);
- a non-empty live list needs the saved length inside a ``state_dict()`` (an optimizer's
  ``param_groups`` and their ``params``) or when it holds tensors or containers; a list of plain
  values (a history) is refilled with the saved items;
- a live object with ``state_dict`` / ``load_state_dict`` (a module, an optimizer, a scheduler)
  is checked through its ``state_dict()``, so an optimizer with another number of parameter
  groups, or a module with other keys, is refused before its ``load_state_dict`` runs;
- anything else is taken from the checkpoint, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.errors import CodecError
from strata.format.codec.common import TENSOR_TAG, CheckedEntry, is_stateful, key_str
from strata.format.codec.tree import TreeReader
from strata.format.manifest import Manifest

MAX_LISTED = 8
"""Differences named in the error (the count says how many more)."""


def check_fits(
    state: Any,
    manifest: Manifest,
    where: str,
    *,
    checked: dict[int, CheckedEntry] | None = None,
) -> None:
    """Raise :class:`CodecError` (naming ``where``, each differing path and what differs) when
    the checkpoint described by ``manifest`` cannot be loaded into ``state`` in place; change
    nothing. See the module docstring for the rules. ``checked``: the loading decoder's cache of
    checked tensor entries (:attr:`strata.format.codec.tree.TreeReader.checked`), filled here so the
    load does not check them again."""
    dec = TreeReader(manifest, where, checked)
    diffs: list[str] = []
    _fit(dec, manifest.tree, state, "state", diffs, strict=False)
    if diffs:
        more = f" (and {len(diffs) - MAX_LISTED} more)" if len(diffs) > MAX_LISTED else ""
        raise CodecError(
            f"{where}: the checkpoint does not fit the live state, nothing was restored: "
            + "; ".join(diffs[:MAX_LISTED])
            + more
            + ". Build the same model/optimizer (configuration) as the run that saved it, or "
            "restore into an empty state"
        )


def _kind(node: Any) -> str:
    if isinstance(node, dict) and node:
        tag = next(iter(node))
        if tag == TENSOR_TAG:
            return "a tensor"
        if isinstance(tag, str) and tag.startswith("__"):
            return str(tag).strip("_")
        return "a dict"
    if isinstance(node, list):
        return "a list"
    return type(node).__name__


def _fit(dec: TreeReader, node: Any, live: Any, path: str, diffs: list[str], strict: bool) -> None:
    if is_stateful(live) and not isinstance(live, (dict, list, torch.Tensor)):
        _fit(dec, node, live.state_dict(), path, diffs, strict=True)
        return
    tag = next(iter(node), None) if isinstance(node, dict) else None
    if tag == "__sharded__":
        return  # a sharded tensor: its resharding restore checks its global layout
    if isinstance(live, torch.Tensor):
        if tag != TENSOR_TAG:
            diffs.append(f"{path}: live tensor, the checkpoint holds {_kind(node)}")
            return
        try:
            te, _se, dt = dec.check_entry(int(node[TENSOR_TAG]))
        except (CodecError, TypeError, ValueError) as exc:
            diffs.append(f"{path}: {exc}")
            return
        if dt != live.dtype or te.shape != list(live.shape):
            diffs.append(
                f"{path}: checkpoint {te.dtype}{te.shape}, live "
                f"{str(live.dtype).removeprefix('torch.')}{list(live.shape)}"
            )
        return
    if isinstance(live, dict):
        saved = _saved_items(dec, node, path)
        if saved is None:
            if live:
                diffs.append(f"{path}: live dict, the checkpoint holds {_kind(node)}")
            return
        if live and saved:
            missing = [k for k in live if k not in saved]
            extra = [k for k in saved if k not in live]
            if missing:
                diffs.append(f"{path}: keys {missing} are live but not in the checkpoint")
            if extra:
                diffs.append(f"{path}: keys {extra} are in the checkpoint but not live")
        for k, v in saved.items():
            if k in live:
                _fit(dec, v, live[k], f"{path}{key_str(k)}", diffs, strict)
        return
    if isinstance(live, list):
        if not isinstance(node, list):
            if live:
                diffs.append(f"{path}: live list, the checkpoint holds {_kind(node)}")
            return
        structured = strict or any(
            isinstance(x, (torch.Tensor, dict, list)) or is_stateful(x) for x in live
        )
        if not structured:
            return
        if live and len(live) != len(node):
            diffs.append(f"{path}: {len(node)} items in the checkpoint, {len(live)} live")
        for i, (v, lv) in enumerate(zip(node, live, strict=False)):
            _fit(dec, v, lv, f"{path}[{i}]", diffs, strict)
        return
    if isinstance(live, tuple) and tag == "__tuple__" and len(live) == len(node[tag]):
        for i, (v, lv) in enumerate(zip(node[tag], live, strict=True)):
            _fit(dec, v, lv, f"{path}[{i}]", diffs, strict)


def _saved_items(dec: TreeReader, node: Any, path: str) -> dict[Any, Any] | None:
    """The saved mapping at ``node`` (key -> child node), or None when it is not a mapping."""
    if not isinstance(node, dict):
        return None
    if not node:
        return {}
    tag = next(iter(node))
    if not tag.startswith("__"):
        return dict(node)
    if tag == "__dict__":
        return {dec.value(k, path): v for k, v in node["__dict__"]}
    return None
