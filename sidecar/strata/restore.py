"""Restore: which step to load (pure planning) and getting one shard into RAM (staging).

DESIGN.md "Restore (nearest surviving tier)":

1. each rank takes an inventory (:func:`collect_inventory`): per tier, the steps and the ranks
   whose shard is committed there; data without a manifest (C-03) and steps of another world
   size are noted and left out;
2. with torch.distributed the ranks all-gather their inventories so that :func:`plan_restore`,
   a pure function of the gathered inventories, picks the *same* step on every rank: the newest
   step for which EVERY rank has a committed shard in some tier it can reach. Ranks never mix
   steps (C-07). A *local* tier (RAM: a node's tmpfs) only serves the rank that reported it; a
   shared tier (PVC, GCS) serves every rank;
3. each rank stages its shard (:func:`stage_shard`): RAM hit verified in place, else copied from
   the next tier and verified; a mismatch quarantines that copy and falls to the next tier
   (C-04; a quarantined copy is no longer listed, so it is never retried in a loop); when no tier
   serves, :class:`StageError` tells the caller to re-plan without that step.

The socket-backed sidecar implements the same inventory / stage steps; both speak
:class:`RankInventory` and :class:`StageResult`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata import crc
from strata.config import TIER_ORDER
from strata.manifest import Manifest
from strata.tiers.base import ShardCorrupt, ShardUnavailable, StepListing, Tier, TierError
from strata.tiers.ram import RamTier, SlotLease

log = logging.getLogger(__name__)

LOCAL_TIERS: frozenset[str] = frozenset({"ram"})
"""Tiers whose content only the reporting rank (its node) can read."""

Holdings = Mapping[str, Mapping[int, frozenset[int]]]
"""tier name -> step -> ranks whose shard of that step is committed in that tier."""


@dataclass(frozen=True)
class RankInventory:
    """What one rank can see: committed (and partial) shards per tier and step, plus notes."""

    rank: int
    world_size: int
    committed: Holdings
    partial: Holdings = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins (for all_gather_object and the sidecar socket)."""

        def plain(h: Holdings) -> dict[str, dict[int, list[int]]]:
            return {t: {s: sorted(r) for s, r in steps.items()} for t, steps in h.items()}

        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "committed": plain(self.committed),
            "partial": plain(self.partial),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankInventory:
        def holdings(
            h: Mapping[str, Mapping[Any, Iterable[int]]],
        ) -> dict[str, dict[int, frozenset[int]]]:
            return {
                t: {int(s): frozenset(int(r) for r in rs) for s, rs in steps.items()}
                for t, steps in h.items()
            }

        return cls(
            rank=int(d["rank"]),
            world_size=int(d["world_size"]),
            committed=holdings(d.get("committed", {})),
            partial=holdings(d.get("partial", {})),
            notes=tuple(d.get("notes", ())),
        )


@dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores and, per rank, the tiers holding its shard (nearest first)."""

    step: int
    sources: Mapping[int, tuple[str, ...]]


def shard_sources(
    inventories: Sequence[RankInventory],
    world_size: int,
    step: int,
    order: Sequence[str] = TIER_ORDER,
    local_tiers: frozenset[str] = LOCAL_TIERS,
) -> dict[int, tuple[str, ...]]:
    """Per rank, the tiers (in ``order``) from which that rank can read its shard of ``step``."""
    by_rank = {inv.rank: inv for inv in inventories}
    out: dict[int, tuple[str, ...]] = {}
    for r in range(world_size):
        tiers = []
        for t in order:
            if t in local_tiers:
                own = by_rank.get(r)
                ok = own is not None and r in own.committed.get(t, {}).get(step, frozenset())
            else:
                ok = any(
                    r in inv.committed.get(t, {}).get(step, frozenset()) for inv in inventories
                )
            if ok:
                tiers.append(t)
        out[r] = tuple(tiers)
    return out


def restorable_steps(
    inventories: Sequence[RankInventory],
    world_size: int,
    order: Sequence[str] = TIER_ORDER,
    exclude: Iterable[int] = (),
    local_tiers: frozenset[str] = LOCAL_TIERS,
) -> list[int]:
    """Steps for which every rank 0..world_size-1 can read a committed shard, newest first."""
    excluded = set(exclude)
    candidates = {
        s for inv in inventories for steps in inv.committed.values() for s in steps
    } - excluded
    return sorted(
        (
            s
            for s in candidates
            if all(shard_sources(inventories, world_size, s, order, local_tiers).values())
        ),
        reverse=True,
    )


def plan_restore(
    inventories: Sequence[RankInventory],
    world_size: int,
    order: Sequence[str] = TIER_ORDER,
    exclude: Iterable[int] = (),
    local_tiers: frozenset[str] = LOCAL_TIERS,
) -> RestorePlan | None:
    """The newest restorable step (see the module docstring), or None when there is none.

    Pure and deterministic: every rank given the same gathered inventories gets the same plan.
    ``exclude``: steps that failed to stage on some rank (re-planning). Without
    torch.distributed only the own inventory is known; other ranks are then served only by
    shared tiers (their RAM is invisible), so ranks still agree unless RAM alone decides.
    """
    for inv in inventories:
        if inv.world_size != world_size:
            raise ValueError(
                f"rank {inv.rank} runs with world size {inv.world_size}, this rank with "
                f"{world_size}: every rank must agree on WORLD_SIZE"
            )
    steps = restorable_steps(inventories, world_size, order, exclude, local_tiers)
    if not steps:
        return None
    step = steps[0]
    return RestorePlan(step, shard_sources(inventories, world_size, step, order, local_tiers))


def skipped_partial_steps(inventories: Sequence[RankInventory]) -> list[str]:
    """Human-readable notes for step directories with data but no manifest (C-03)."""
    notes = []
    for inv in inventories:
        for tier, steps in inv.partial.items():
            for step, ranks in sorted(steps.items()):
                notes.append(
                    f"{tier}: step {step} has data without a manifest for ranks "
                    f"{sorted(ranks)} (a save or promotion was interrupted); skipped"
                )
    return sorted(set(notes))


def collect_inventory(
    tiers: Sequence[Tier], job_id: str, rank: int, world_size: int
) -> RankInventory:
    """List every tier (nearest first) for ``job_id``: one rank's :class:`RankInventory`.

    A tier that cannot be listed is noted and left out (restore falls back to the others).
    Steps whose manifests record another world size, or none readable (unknown format version,
    malformed), are noted and left out: they cannot be restored by this job as it runs.
    """
    committed: dict[str, dict[int, frozenset[int]]] = {}
    partial: dict[str, dict[int, frozenset[int]]] = {}
    notes: list[str] = []
    for tier in tiers:
        try:
            listing = tier.list_steps(job_id)
        except (TierError, OSError) as exc:
            notes.append(f"{tier.name}: not searched: {exc}")
            continue
        c: dict[int, frozenset[int]] = {}
        p: dict[int, frozenset[int]] = {}
        for step, entry in listing.items():
            if entry.partial_ranks:
                p[step] = entry.partial_ranks
            if not entry.committed_ranks:
                continue
            if entry.world_size is None:
                notes.append(
                    f"{tier.name}: step {step} skipped: {_why_unreadable(tier, job_id, step, entry)}"
                )
            elif entry.world_size != world_size:
                notes.append(
                    f"{tier.name}: step {step} was written with world size {entry.world_size}, "
                    f"this job runs with {world_size} (resharding is not supported); skipped"
                )
            else:
                c[step] = entry.committed_ranks
        committed[tier.name] = c
        partial[tier.name] = p
    return RankInventory(rank, world_size, committed, partial, tuple(notes))


def _why_unreadable(tier: Tier, job_id: str, step: int, entry: StepListing) -> str:
    try:
        tier.get_manifest(job_id, step, min(entry.committed_ranks))
    except TierError as exc:
        return str(exc)
    return "no readable manifest (malformed or written by another Strata version)"


@dataclass
class StageResult:
    """Provenance of one staged shard: where it came from and where it now lies."""

    tier: str
    """The tier that served it (``ram`` for a RAM hit)."""
    path: Path
    """The data object to load (the RAM shard itself, or the slot it was copied into)."""
    manifest: Manifest
    nbytes: int
    seconds: float
    skipped: list[str] = field(default_factory=list)
    """Why nearer tiers did not serve (missing, quarantined after a mismatch, ...)."""


class StageError(ShardUnavailable):
    """No tier could serve the shard; re-plan without this step. ``skipped`` says why, per tier."""

    def __init__(self, message: str, skipped: list[str]) -> None:
        super().__init__(message)
        self.skipped = skipped


SlotTarget = Path | Callable[[int], Path]
"""Where a copied shard goes: a path, or a callable giving a path for ``nbytes`` (a RAM slot)."""


def stage_shard(
    tiers: Sequence[Tier],
    job_id: str,
    step: int,
    rank: int,
    slot_path: SlotTarget,
    *,
    world_size: int | None = None,
    verify: bool = True,
) -> StageResult:
    """Get rank ``rank``'s shard of ``step`` from the nearest tier of ``tiers`` that verifies.

    - :class:`RamTier`: a RAM hit is verified in place under a :class:`SlotLease` (a shard
      whose writer died before its checksum pass is checksummed now and its manifest updated;
      noted in ``skipped``); ``path`` is the RAM data file.
    - any other tier: ``fetch_shard`` into ``slot_path`` (verified while copying).
    - ``ShardCorrupt`` (checksum mismatch, truncation, a manifest naming another shard):
      that copy is quarantined and the next tier is tried. ``ShardUnavailable`` / other
      ``TierError`` (missing, another job or version or world size, unreachable): noted, next.

    Each tier is tried once. Raises :class:`StageError` (listing every tier searched and why)
    when none serves; the caller re-plans without ``step``.
    """
    skipped: list[str] = []
    for tier in tiers:
        t0 = time.perf_counter()
        try:
            if isinstance(tier, RamTier):
                m, path = _stage_ram(tier, job_id, step, rank, world_size, verify, skipped)
            else:
                m = tier.get_manifest(job_id, step, rank)
                _check_world(m, world_size, tier)
                path = slot_path(m.data_nbytes) if callable(slot_path) else Path(slot_path)
                m = tier.fetch_shard(job_id, step, rank, path, verify=verify)
                _check_world(m, world_size, tier)
        except ShardCorrupt as exc:
            skipped.append(f"{tier.name}: {exc} (quarantined)")
            try:
                tier.quarantine(job_id, step, rank, str(exc))
            except TierError as qexc:
                skipped.append(f"{tier.name}: quarantine failed: {qexc}")
            continue
        except (TierError, OSError) as exc:
            skipped.append(f"{tier.name}: {exc}")
            continue
        return StageResult(tier.name, path, m, m.data_nbytes, time.perf_counter() - t0, skipped)
    searched = ", ".join(f"{t.name}" for t in tiers) or "no tiers"
    raise StageError(
        f"no tier could serve rank {rank} of step {step} of job {job_id!r} (searched {searched}): "
        + "; ".join(skipped),
        skipped,
    )


def _check_world(m: Manifest, world_size: int | None, tier: Tier) -> None:
    if world_size is not None and m.world_size != world_size:
        raise ShardUnavailable(
            f"{tier.name}: step {m.step} rank {m.rank} was written with world size "
            f"{m.world_size}, this job runs with {world_size}"
        )


def _stage_ram(
    tier: RamTier,
    job_id: str,
    step: int,
    rank: int,
    world_size: int | None,
    verify: bool,
    skipped: list[str],
) -> tuple[Manifest, Path]:
    with SlotLease(tier, job_id, step, rank) as lease:
        m = lease.manifest
        assert m is not None
        _check_world(m, world_size, tier)
        if verify and m.verified:
            tier.verify_file(lease.path, m)
        elif verify:
            crcs, whole = crc.file_chunk_crcs(lease.path, m.data_nbytes, m.chunk_size)
            sealed = tier.update_checksums(job_id, step, rank, crcs, whole)
            m = sealed if sealed is not None else tier.get_manifest(job_id, step, rank)
            skipped.append(
                f"ram: step {step} rank {rank} had no checksums yet (its writer stopped before "
                "the checksum pass); checksummed now, not verified against an earlier record"
            )
        return m, lease.path
