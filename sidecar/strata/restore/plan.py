"""Restore planning: which step every rank loads (pure; no I/O, no tiers).

docs/architecture.md "Restore (nearest surviving tier)":

1. each rank takes an inventory (:func:`collect_inventory`): per tier, the steps and the ranks
   whose shard is committed there; data without a manifest (C-03) and steps of another world
   size are noted and left out;
2. with torch.distributed the ranks all-gather their inventories so that :func:`plan_restore`,
   a pure function of the gathered inventories, picks the *same* step on every rank: the newest
   step for which EVERY rank has a committed shard in some tier it can reach, all of ONE live
   incarnation (a shared tier's step counts only with its global commit record; the
   lineage of the gathered incarnation records rules out superseded steps). Ranks never mix
   steps (C-07) nor incarnations. A *local* tier (RAM: a node's tmpfs) only serves the rank that reported it; a
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strata.config import TIER_ORDER
from strata.format.incarnation import Incarnation, Lineage

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
    incarnations: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    """tier -> step -> incarnation of the shards (RAM: this rank's; shared tiers: the step's
    commit record); a step absent here belongs to no incarnation (``""``)."""
    unusable: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """tier -> steps whose commit record this rank cannot use: its own shard there is not the
    one committed (replaced, e.g. by another incarnation's replay)."""
    records: tuple[Mapping[str, Any], ...] = ()
    """Incarnation records this rank found (:class:`strata.format.incarnation.Incarnation`
    as JSON-mode dicts); the plan follows the lineage of their union."""

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
            "incarnations": {t: dict(steps) for t, steps in self.incarnations.items()},
            "records": [dict(r) for r in self.records],
            "unusable": {t: sorted(s) for t, s in self.unusable.items()},
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
            incarnations={
                t: {int(s): str(i) for s, i in steps.items()}
                for t, steps in d.get("incarnations", {}).items()
            },
            records=tuple(d.get("records", ())),
            unusable={
                t: frozenset(int(s) for s in steps) for t, steps in d.get("unusable", {}).items()
            },
        )


@dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores and, per rank, the tiers holding its shard (nearest first)."""

    step: int
    sources: Mapping[int, tuple[str, ...]]
    incarnation: str = ""
    """The incarnation whose shards every rank loads (never a mix)."""
    lineage: Lineage = field(default_factory=lambda: Lineage(()), compare=False)
    """The lineage the step was chosen by (the gathered records'; the new incarnation's record
    copies its chain)."""


def shard_sources(
    inventories: Sequence[RankInventory],
    world_size: int,
    step: int,
    order: Sequence[str] = TIER_ORDER,
    local_tiers: frozenset[str] = LOCAL_TIERS,
    incarnation: str | None = None,
) -> dict[int, tuple[str, ...]]:
    """Per rank, the tiers (in ``order``) from which that rank can read its shard of ``step``
    (``incarnation``: only shards of that incarnation; None: any)."""
    by_rank = {inv.rank: inv for inv in inventories}

    def holds(inv: RankInventory, t: str, r: int) -> bool:
        if r not in inv.committed.get(t, {}).get(step, frozenset()):
            return False
        return incarnation is None or _inc(inv, t, step) == incarnation

    # A shared tier serves rank r when any inventory holds r there: one union per tier (every
    # rank lists the whole shared tier, so testing each rank against each inventory is O(W^2)).
    served: dict[str, set[int]] = {}
    for t in order:
        if t not in local_tiers:
            served[t] = set()
            for inv in inventories:
                if incarnation is None or _inc(inv, t, step) == incarnation:
                    served[t].update(inv.committed.get(t, {}).get(step, frozenset()))
    out: dict[int, tuple[str, ...]] = {}
    for r in range(world_size):
        tiers = []
        for t in order:
            own = by_rank.get(r)
            if t in local_tiers:
                ok = own is not None and holds(own, t, r)
            elif own is not None and step in own.unusable.get(t, frozenset()):
                ok = False  # the rank found its own shard there is not the committed one
            else:
                ok = r in served[t]
            if ok:
                tiers.append(t)
        out[r] = tuple(tiers)
    return out


def _inc(inv: RankInventory, tier: str, step: int) -> str:
    return inv.incarnations.get(tier, {}).get(step, "")


def lineage_of(inventories: Sequence[RankInventory]) -> Lineage:
    """The lineage of the union of every rank's incarnation records (bad records skipped).
    Each record is parsed once, however many ranks shipped it (every rank lists the shared
    tiers: W copies of each)."""
    recs: dict[str, Incarnation] = {}
    for inv in inventories:
        for d in inv.records:
            if d.get("id") in recs:
                continue
            try:
                rec = Incarnation.model_validate(d)
            except ValueError:
                continue
            recs.setdefault(rec.id, rec)
    return Lineage(recs.values())


def step_incarnation(
    inventories: Sequence[RankInventory],
    world_size: int,
    step: int,
    order: Sequence[str] = TIER_ORDER,
    local_tiers: frozenset[str] = LOCAL_TIERS,
    lineage: Lineage | None = None,
) -> str | None:
    """The live incarnation of which every rank can read its shard of ``step`` (the newest
    such when several are), or None: the step is not restorable as one incarnation."""
    lineage = lineage_of(inventories) if lineage is None else lineage
    incs = {
        _inc(inv, t, step)
        for inv in inventories
        for t, steps in inv.committed.items()
        if step in steps
    }
    for inc in sorted(incs, reverse=True):  # ids are ordered by creation time
        if not lineage.live(inc, step):
            continue
        if all(shard_sources(inventories, world_size, step, order, local_tiers, inc).values()):
            return inc
    return None


def restorable_steps(
    inventories: Sequence[RankInventory],
    world_size: int,
    order: Sequence[str] = TIER_ORDER,
    exclude: Iterable[int] = (),
    local_tiers: frozenset[str] = LOCAL_TIERS,
    lineage: Lineage | None = None,
) -> list[int]:
    """Steps for which every rank 0..world_size-1 can read a committed shard of one live
    incarnation (:func:`step_incarnation`), newest first. ``lineage``: that of the gathered
    records (default: built from them)."""
    excluded = set(exclude)
    lineage = lineage_of(inventories) if lineage is None else lineage
    candidates = {
        s for inv in inventories for steps in inv.committed.values() for s in steps
    } - excluded
    return sorted(
        (
            s
            for s in candidates
            if step_incarnation(inventories, world_size, s, order, local_tiers, lineage) is not None
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
    lineage = lineage_of(inventories)
    steps = restorable_steps(inventories, world_size, order, exclude, local_tiers, lineage)
    if not steps:
        return None
    step = steps[0]
    inc = step_incarnation(inventories, world_size, step, order, local_tiers, lineage)
    assert inc is not None
    return RestorePlan(
        step, shard_sources(inventories, world_size, step, order, local_tiers, inc), inc, lineage
    )


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
