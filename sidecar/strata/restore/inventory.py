"""One rank's inventory: what every tier holds of the job, for :mod:`strata.restore.plan`.

Talks to tiers only through the :class:`strata.tiers.base.Tier` contract.
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.errors import TierError
from strata.restore.plan import RankInventory
from strata.tiers.base import StepListing, Tier


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
