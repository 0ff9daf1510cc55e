"""The trainer's hint that a storage did not change between saves (issue 18).

:class:`UnchangedTracker` records, per storage of each save, the step since which the trainer
has seen it unchanged: same address, size and device, and no bump of the version counter of any
tensor viewing it. The versions are read by the saver on the training thread as of the bytes it
copied (a few ns per tensor); everything else runs in the background checksum pass
(:meth:`UnchangedTracker.since`, in save order). It is a HINT: ``tensor.data`` writes, ``set_()`` and an
allocator handing a freed address to a new tensor of the same size can fool it, so the promotion
references a chunk only when its CRC32C agrees too (:func:`strata.format.incremental.plan_refs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Snapshot:
    """What one save saw: the encoded tensors, their version counters as of the bytes copied
    (read on the training thread; -1: no counter, e.g. inference tensors), the storages'
    uint8 views (``EncodedState.sources``)."""

    live: list[torch.Tensor]
    versions: list[int]
    sources: list[torch.Tensor]


class UnchangedTracker:
    """Per-storage ``unchanged_since`` steps across the saves of one rank (see module docstring)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[tuple[object, ...], int]] = {}
        """storage address -> (signature at the last save, step since which it is unchanged)."""

    def since(self, step: int, snap: Snapshot) -> list[int]:
        """Per storage of the save of ``step``: the step since which it is unchanged (``step``
        itself when it changed or is new). Call in save order (the background thread)."""
        versions: dict[int, int | None] = {}
        for t, v in zip(snap.live, snap.versions, strict=True):
            key = t.untyped_storage().data_ptr()
            prior = versions.get(key, 0)
            versions[key] = None if v < 0 or prior is None else prior + v + 1
        seen: dict[int, tuple[tuple[object, ...], int]] = {}
        out: list[int] = []
        for src in snap.sources:
            key = src.data_ptr()
            total = versions.get(key)
            sig = (src.numel(), str(src.device), total)
            prev = self._seen.get(key)
            since = prev[1] if total is not None and prev is not None and prev[0] == sig else step
            seen[key] = (sig, since)
            out.append(since)
        self._seen = seen
        return out
