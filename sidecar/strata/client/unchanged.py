"""The trainer's hint that a storage did not change between saves.

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


Signature = tuple[int, int, str, tuple[int, ...]]
"""A storage as a save saw it: (address, nbytes, device, the version counters of the tensors
viewing it, in the state's order). The counters themselves, not their sum: a state that drops
one of two views while the other changes once ((0+1) + (0+1) == 1+1) must not look unchanged."""


def storage_signatures(
    live: list[torch.Tensor], versions: list[int], sources: list[torch.Tensor]
) -> list[Signature | None]:
    """Per storage of ``sources``: its :data:`Signature` given the version counters
    ``versions`` of the tensors ``live`` (same length), or None when some tensor viewing it
    has no counter (-1) or none does. ~0.3 us per tensor (one storage pointer read each)."""
    counters: dict[int, list[int] | None] = {}
    for t, v in zip(live, versions, strict=True):
        key = t.untyped_storage().data_ptr()
        prior = counters.setdefault(key, [])
        if v < 0:
            counters[key] = None
        elif prior is not None:
            prior.append(v)
    out: list[Signature | None] = []
    for src in sources:
        key = src.data_ptr()
        seen = counters.get(key)
        out.append(None if not seen else (key, src.numel(), str(src.device), tuple(seen)))
    return out


class UnchangedTracker:
    """Per-storage ``unchanged_since`` steps across the saves of one rank (see module docstring)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[tuple[object, ...], int]] = {}
        """storage address -> (signature at the last save, step since which it is unchanged)."""

    def since(
        self, step: int, snap: Snapshot, sigs: list[Signature | None] | None = None
    ) -> list[int]:
        """Per storage of the save of ``step``: the step since which it is unchanged (``step``
        itself when it changed or is new). Call in save order (the background thread).
        ``sigs``: :func:`storage_signatures` of ``snap`` when the caller has them already."""
        if sigs is None:
            sigs = storage_signatures(snap.live, snap.versions, snap.sources)
        seen: dict[int, tuple[tuple[object, ...], int]] = {}
        out: list[int] = []
        for src, full in zip(snap.sources, sigs, strict=True):
            key = src.data_ptr()
            sig = (src.numel(), str(src.device), None if full is None else full[3])
            prev = self._seen.get(key)
            since = prev[1] if full is not None and prev is not None and prev[0] == sig else step
            seen[key] = (sig, since)
            out.append(since)
        self._seen = seen
        return out
