"""``strata list`` (what every location holds) and ``strata plan`` (what a restore would pick).

``plan`` reuses the restore planning package (:func:`strata.restore.collect_inventory`,
:func:`strata.restore.plan_restore`, :func:`strata.restore.shard_sources`): it is the decision
the trainer makes, taken as if every rank ran where the given RAM directory is (a RAM tier only
serves the ranks whose shard it holds). With ``verify`` each would-be serving copy is checked
first, as staging does (a bad copy falls to the next tier, a step no tier serves for some rank
is excluded and the plan retaken); nothing is quarantined: the CLI never writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from strata.cli import output
from strata.cli.locations import Location, NotFound, UsageError
from strata.config import TIER_ORDER
from strata.errors import ShardCorrupt, TierError
from strata.format.manifest import Manifest
from strata.restore import collect_inventory, plan_restore, restorable_steps, shard_sources
from strata.restore.plan import RankInventory
from strata.tiers.base import StepListing, Tier

# -- list ------------------------------------------------------------------------------------------


def step_row(loc: Location, job: str, listing: StepListing) -> dict[str, Any]:
    """One row of ``strata list``: a step of ``job`` in ``loc`` (reads its manifests).

    ``created``: when the step's oldest shard was written, RFC 3339 in UTC (the directory's
    mtime when no manifest is readable)."""
    manifests: list[Manifest] = []
    unreadable: list[str] = []
    for r in sorted(listing.committed_ranks):
        try:
            manifests.append(loc.tier.get_manifest(job, listing.step, r))
        except TierError as exc:
            unreadable.append(f"rank {r}: {exc}")
    created = min((m.created.timestamp() for m in manifests), default=listing.mtime)
    incarnations = sorted({str(i) for m in manifests if (i := m.incarnation)})
    return {
        "tier": loc.kind,
        "location": loc.spec,
        "job": job,
        "step": listing.step,
        "complete": listing.complete,
        "committed_ranks": sorted(listing.committed_ranks),
        "partial_ranks": sorted(listing.partial_ranks),
        "world_size": listing.world_size,
        "incarnation": ",".join(incarnations) or None,
        "commit_record": listing.has_commit if loc.kind != "ram" else None,
        "bytes": sum(m.data_nbytes for m in manifests),
        # what the copies hold (archive-only components; incremental base steps)
        "archive_only": sorted({c for m in manifests for c in (m.components or [])}) or None,
        "refs_base_steps": sorted({m.refs.base_step for m in manifests if m.refs}) or None,
        "created": None if created is None else output.rfc3339(created),
        "problems": unreadable,
    }


def list_rows(locations: Sequence[Location], jobs: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for loc in locations:
        for job in jobs:
            for _step, listing in sorted(loc.tier.list_steps(job).items(), reverse=True):
                rows.append(step_row(loc, job, listing))
    return rows


# -- plan ------------------------------------------------------------------------------------------


@dataclass
class RankSource:
    rank: int
    tier: str | None
    location: str | None
    skipped: list[str] = field(default_factory=list)


@dataclass
class PlanResult:
    job: str
    world_size: int
    step: int | None
    ranks: list[RankSource]
    newer_skipped: list[str]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "world_size": self.world_size,
            "step": self.step,
            "ranks": [
                {"rank": r.rank, "tier": r.tier, "location": r.location, "skipped": r.skipped}
                for r in self.ranks
            ],
            "newer_steps_skipped": self.newer_skipped,
            "notes": self.notes,
        }


def _by_kind(locations: Sequence[Location]) -> dict[str, Location]:
    out: dict[str, Location] = {}
    for loc in locations:
        if loc.kind in out:
            raise UsageError(
                f"{out[loc.kind].spec!r} and {loc.spec!r} are both {loc.kind} tiers; a restore "
                "searches one location per tier: give each tier once"
            )
        out[loc.kind] = loc
    return out


def default_world_size(locations: Sequence[Location], job: str) -> int:
    """The world size of the newest step with a readable manifest in any location."""
    best: tuple[int, int] | None = None
    for loc in locations:
        for step, listing in loc.tier.list_steps(job).items():
            if listing.world_size is not None and (best is None or step > best[0]):
                best = (step, listing.world_size)
    if best is None:
        raise NotFound(
            f"job {job!r}: no committed step in {', '.join(loc.spec for loc in locations)}"
        )
    return best[1]


def _why_not(
    tier: str, loc: Location | None, inv: RankInventory, step: int, rank: int
) -> str | None:
    """Why ``tier`` cannot serve ``rank``'s shard of ``step`` from the inventory alone."""
    if loc is None:
        return f"{tier}: not given on the command line"
    for note in inv.notes:
        if note.startswith(f"{tier}:") and (f"step {step} " in note or "not searched" in note):
            return note
    if rank in inv.partial.get(tier, {}).get(step, frozenset()):
        return f"{tier}: data without a manifest (a save or promotion was interrupted)"
    if step not in inv.committed.get(tier, {}):
        return f"{tier}: holds no copy of step {step}"
    if rank not in inv.committed[tier][step]:
        return f"{tier}: rank {rank} of step {step} is not committed there"
    return None


def _check(tier: Tier, job: str, step: int, rank: int) -> str | None:
    try:
        m = tier.get_manifest(job, step, rank)
        if m.verified:
            tier.verify_shard(job, step, rank)
    except ShardCorrupt as exc:
        return f"{tier.name}: {exc} (a restore quarantines this copy and falls back)"
    except TierError as exc:
        return f"{tier.name}: {exc}"
    return None


def plan(
    locations: Sequence[Location],
    job: str,
    world_size: int | None,
    *,
    verify: bool = False,
    order: Sequence[str] = TIER_ORDER,
) -> PlanResult:
    """The restore decision for ``job`` (see the module docstring)."""
    by_kind = _by_kind(locations)
    tiers = [by_kind[t].tier for t in order if t in by_kind]
    world = world_size if world_size is not None else default_world_size(locations, job)
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    # Every rank "sees" everything given here, so a RAM directory serves the ranks it holds.
    invs = [collect_inventory(tiers, job, r, world) for r in range(world)]
    notes = sorted({n for inv in invs for n in inv.notes})
    excluded: list[int] = []
    newer: list[str] = []
    while True:
        chosen = plan_restore(invs, world, order, exclude=excluded)
        if chosen is None:
            break
        ranks: list[RankSource] = []
        unserved: list[int] = []
        for r in range(world):
            src = RankSource(r, None, None)
            serving = set(chosen.sources[r])
            for t in order:
                if t not in serving:
                    reason = _why_not(t, by_kind.get(t), invs[r], chosen.step, r)
                    if reason and by_kind.get(t) is not None:
                        src.skipped.append(reason)
                    continue
                bad = _check(by_kind[t].tier, job, chosen.step, r) if verify else None
                if bad is not None:
                    src.skipped.append(bad)
                    continue
                src.tier, src.location = t, by_kind[t].spec
                break
            if src.tier is None:
                unserved.append(r)
            ranks.append(src)
        if not unserved:
            newer = _not_restorable(invs, world, chosen.step) + newer
            return PlanResult(job, world, chosen.step, ranks, newer, notes)
        excluded.append(chosen.step)
        newer.append(
            f"step {chosen.step}: no verified copy for rank(s) {unserved}; "
            + "; ".join(s for r in ranks if r.rank in unserved for s in r.skipped)
        )
    return PlanResult(job, world, None, [], _not_restorable(invs, world, None) + newer, notes)


def _not_restorable(invs: Sequence[RankInventory], world: int, above: int | None) -> list[str]:
    """Why steps newer than ``above`` are not restorable: ranks committed in no tier given."""
    ok = set(restorable_steps(invs, world))
    seen = {s for inv in invs for steps in inv.committed.values() for s in steps}
    out = []
    for s in sorted(seen, reverse=True):
        if above is not None and s <= above:
            break
        if s not in ok:
            missing = [r for r, t in shard_sources(invs, world, s).items() if not t]
            out.append(f"step {s}: rank(s) {missing} committed in no tier given")
    return out
