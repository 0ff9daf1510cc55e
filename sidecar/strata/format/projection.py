"""Archive-only shards: a tier that keeps only chosen top-level components of the
state (e.g. ``model`` and not ``optim``, 2/3 of an Adam checkpoint).

:func:`project` turns the manifest of a full shard into the manifest of the shard holding only
``components`` (top-level keys of the state dict): the tree keeps those keys, the tensors and
storages they reach are renumbered and laid out back to back again (aligned to
:data:`~strata.format.manifest.ALIGN`), and ``Manifest.components`` records what was kept. Such
a shard is *archive-only*: it is listed, verified and exported like any other, and never used
to resume training (:func:`strata.restore.staging.stage_shard` refuses it).

No I/O here: the caller copies the returned pieces from the full data object and checksums the
result (:mod:`strata.tiers.references` has the writer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from strata.errors import FormatError
from strata.format.manifest import ALIGN, Manifest, StorageEntry

TENSOR_TAG = "__tensor__"
"""The codec's tensor tag (:data:`strata.format.codec.TENSOR_TAG`; not imported: the codec
needs torch and the sidecar runs without it)."""

Piece = tuple[int, int, int]
"""(offset in the full data object, offset in the projected one, bytes)."""


def _top_level(tree: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(tree, dict) and not any(str(k).startswith("__") for k in tree):
        return list(tree.items())
    if isinstance(tree, dict) and list(tree) == ["__dict__"]:
        return [(k, v) for k, v in tree["__dict__"]]
    return None


def _tensor_indices(node: Any, out: list[int]) -> None:
    if isinstance(node, dict):
        if TENSOR_TAG in node and isinstance(node[TENSOR_TAG], int):
            out.append(node[TENSOR_TAG])
        for v in node.values():
            _tensor_indices(v, out)
    elif isinstance(node, list):
        for v in node:
            _tensor_indices(v, out)


def _renumber(node: Any, new: dict[int, int]) -> Any:
    if isinstance(node, dict):
        if TENSOR_TAG in node and isinstance(node[TENSOR_TAG], int):
            return {**node, TENSOR_TAG: new[node[TENSOR_TAG]]}
        return {k: _renumber(v, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_renumber(v, new) for v in node]
    return node


def project(m: Manifest, components: Sequence[str]) -> tuple[Manifest, list[Piece]]:
    """(manifest of the shard keeping only ``components``, pieces to copy). The manifest has no
    checksums yet (``chunk_crc32c``/``crc32c`` None) and ``components`` set.

    Raises :class:`FormatError` when the state is not a dict at the top, or holds none of
    ``components`` (say which keys it has), or ``m`` is itself incremental or projected.
    """
    if m.refs is not None:
        raise FormatError("project() needs a full shard, not an incremental copy")
    if m.components is not None:
        raise FormatError(f"step {m.step} rank {m.rank} is already archive-only ({m.components})")
    items = _top_level(m.tree)
    if items is None:
        raise FormatError(
            "an archive tier keeps top-level components of the state, but this state is not a "
            "dict; save a dict such as {'model': ..., 'optim': ...} or drop 'components'"
        )
    wanted = set(components)
    kept = [(k, v) for k, v in items if k in wanted]
    if not kept:
        raise FormatError(
            f"the archive tier keeps components {sorted(wanted)} but the state has "
            f"{sorted(str(k) for k, _ in items)}; fix the tier's 'components'"
        )
    old_tensors: list[int] = []
    for _k, v in kept:
        _tensor_indices(v, old_tensors)
    tensor_map: dict[int, int] = {}
    storage_map: dict[int, int] = {}
    storages: list[StorageEntry] = []
    pieces: list[Piece] = []
    at = 0
    for t in old_tensors:
        if t in tensor_map:
            continue
        tensor_map[t] = len(tensor_map)
        s = m.tensors[t].storage
        if s not in storage_map:
            se = m.storages[s]
            at = -(-at // ALIGN) * ALIGN
            storage_map[s] = len(storages)
            storages.append(StorageEntry(offset=at, nbytes=se.nbytes))
            pieces.append((se.offset, at, se.nbytes))
            at += se.nbytes
    tensors = [
        m.tensors[t].model_copy(update={"storage": storage_map[m.tensors[t].storage]})
        for t in sorted(tensor_map, key=tensor_map.__getitem__)
    ]
    kept_tree = [(k, _renumber(v, tensor_map)) for k, v in kept]
    tree = (
        dict(kept_tree)
        if isinstance(m.tree, dict) and "__dict__" not in m.tree
        else {"__dict__": [[k, v] for k, v in kept_tree]}
    )
    unchanged = None
    if m.unchanged_since is not None:
        inverse = sorted(storage_map, key=storage_map.__getitem__)
        unchanged = [m.unchanged_since[s] for s in inverse]
    projected = m.model_copy(
        update={
            "tree": tree,
            "tensors": tensors,
            "storages": storages,
            "data_nbytes": at,
            "chunk_crc32c": None,
            "crc32c": None,
            "sub_crc32c": None,
            "unchanged_since": unchanged,
            "components": sorted(str(k) for k, _ in kept),
        }
    )
    return projected, pieces
