"""What this node's RAM tier says about the job's current incarnation.

The sidecar never trusts leftover directories for "who is in the world": the *current
incarnation* is the newest one named on this node (an incarnation record the trainer wrote at
restore into ``<ram>/<job>/incarnations/``, or the incarnation stamped into a RAM manifest; ids
are ordered by creation time), its world size comes from its record or its manifests, and the
*local ranks* are the ranks below that world size which either hold a RAM shard of it or were
declared by a live trainer through the local API. Slot directories and shards of other
incarnations (a run at another world size on the same hostPath, a superseded run) are ignored:
they never make the engine wait and never set an interval.

Manifests are parsed once per file version (cached by inode and mtime), so a round costs one
directory listing plus the new manifests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from strata.errors import ShardUnavailable, TierError
from strata.format import layout
from strata.format.incarnation import Incarnation, chain_back
from strata.format.manifest import Manifest
from strata.tiers.base import StepListing
from strata.tiers.ram import RamTier
from strata.tiers.records import collect_incarnations, read_incarnations

log = logging.getLogger("strata.promotion")


@dataclass(frozen=True)
class World:
    """One snapshot of the current incarnation as seen from this node's RAM tier."""

    incarnation: str | None
    """The current incarnation; ``""`` for shards of no incarnation; None: nothing known yet."""
    world_size: int | None
    ranks: frozenset[int]
    """Local ranks of the current incarnation."""
    shards: Mapping[int, Mapping[int, Manifest]] = field(default_factory=dict)
    """step -> rank -> committed RAM manifest (every incarnation)."""
    records: tuple[Incarnation, ...] = ()
    """Incarnation records found in the RAM tier."""

    def steps(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Steps held in RAM for every rank of ``ranks`` (default: the local ranks) by the
        current incarnation, ascending."""
        want = set(self.ranks if ranks is None else ranks)
        if not want or self.incarnation is None:
            return []
        return sorted(
            s
            for s, by_rank in self.shards.items()
            if all(r in by_rank and by_rank[r].incarnation == self.incarnation for r in want)
        )

    def chain(self) -> list[Incarnation]:
        """Records of the current incarnation and its known ancestors (to copy next to a
        commit, so that the tier alone tells live steps from superseded ones)."""
        return chain({r.id: r for r in self.records}, self.incarnation)


def chain(records: Mapping[str, Incarnation], incarnation: str | None) -> list[Incarnation]:
    """The records (id -> record) of ``incarnation`` and its known ancestors, newest first,
    up to the first that carries its own chain (``ancestors``: the rest is redundant)."""
    return chain_back(records, incarnation or None)[0]


class RamWorld:
    """Builds :class:`World` snapshots of job ``job_id`` from the RAM tier ``ram``."""

    def __init__(self, ram: RamTier, job_id: str) -> None:
        self.ram = ram
        self.job_id = job_id
        self._manifests: dict[tuple[int, int], tuple[tuple[int, int], Manifest]] = {}
        self._records: tuple[tuple[str, ...], tuple[Incarnation, ...]] = ((), ())

    def snapshot(self, listing: Mapping[int, StepListing], declared: Iterable[int]) -> World:
        shards: dict[int, dict[int, Manifest]] = {}
        seen: set[tuple[int, int]] = set()
        for step, entry in listing.items():
            for rank in entry.committed_ranks:
                m = self._manifest(step, rank)
                if m is not None:
                    shards.setdefault(step, {})[rank] = m
                    seen.add((step, rank))
        for key in [k for k in self._manifests if k not in seen]:
            del self._manifests[key]
        records = self._read_records()
        ids = {r.id for r in records} | {
            m.incarnation for by_rank in shards.values() for m in by_rank.values()
        }
        current = max(ids, default=None)
        world_size: int | None = None
        rec = next((r for r in records if r.id == current), None)
        if rec is not None:
            world_size = rec.world_size
        else:
            sizes = [
                m.world_size
                for by_rank in shards.values()
                for m in by_rank.values()
                if m.incarnation == current
            ]
            world_size = max(sizes) if sizes else None
        ranks = set(declared)
        ranks.update(
            r for by_rank in shards.values() for r, m in by_rank.items() if m.incarnation == current
        )
        if current is None:
            # Nothing saved yet on this node: the slot rings are all there is to go by.
            ranks.update(self.ram.slot_ranks(self.job_id))
        if world_size is not None:
            ranks = {r for r in ranks if r < world_size}
        return World(current, world_size, frozenset(ranks), shards, records)

    def _manifest(self, step: int, rank: int) -> Manifest | None:
        path = self.ram.manifest_path(self.job_id, step, rank)
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns)
        cached = self._manifests.get((step, rank))
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            m = self.ram.get_manifest(self.job_id, step, rank)
        except ShardUnavailable:  # corrupt or gone: the round's own read deals with it
            return None
        self._manifests[(step, rank)] = (key, m)
        return m

    def _read_records(self) -> tuple[Incarnation, ...]:
        try:
            names = tuple(self.ram.list_records(layout.incarnations_prefix(self.job_id)))
        except TierError:
            return self._records[1]
        if names != self._records[0]:
            try:
                if collect_incarnations(self.ram, self.job_id):
                    names = tuple(self.ram.list_records(layout.incarnations_prefix(self.job_id)))
            except TierError as exc:
                log.info("incarnation records of the RAM tier not collected: %s", exc)
            self._records = (names, tuple(read_incarnations(self.ram, self.job_id)))
        return self._records[1]
