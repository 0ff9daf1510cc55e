"""One rank's inventory: what every tier holds of the job, for :mod:`strata.restore.plan`.

Talks to tiers only through the :class:`strata.tiers.base.Tier` contract.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from strata.errors import ShardCorrupt, TierError
from strata.format.commit import StepCommit
from strata.format.incarnation import Incarnation, Lineage, sufficient
from strata.restore.plan import LOCAL_TIERS, RankInventory
from strata.tiers.base import StepListing, Tier
from strata.tiers.eligible import tier_steps
from strata.tiers.records import read_incarnations, read_manifest_raw

RESHARD_ONLY = (
    "only a resharding restore can load it (the client's default when the state allows it; "
    "never with Checkpointer(reshard=False) or STRATA_RESTORE_RESHARD=0)"
)
"""Said of a step written at another world size than the restoring job's."""


@dataclass
class TierListings:
    """What `list_tiers` found: each listed tier's steps (tier name -> step -> listing), and the
    incarnation records read in them, by id (the first found wins), as records and as
    JSON-mode dicts."""

    steps: dict[str, dict[int, StepListing]] = field(default_factory=dict)
    found: dict[str, Incarnation] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

    def lineage(self) -> Lineage:
        """The lineage of every record found."""
        return Lineage(self.found.values())


def list_tiers(
    tiers: Sequence[Tier], job_id: str, unlisted: Callable[[Tier, Exception], None]
) -> TierListings:
    """List ``job_id``'s steps in each of ``tiers`` and read its incarnation records there.
    A tier that fails (:class:`TierError`, OSError) is passed to ``unlisted`` with the error
    (never raises for it); a tier listed whose records then fail to read stays listed."""
    out = TierListings()
    for tier in tiers:
        try:
            out.steps[tier.name] = tier.list_steps(job_id)
            # the records the lineage needs, not every one the tier keeps (each carries the
            # chain: a job restored 1,800 times shipped 1.1 MB per rank before)
            for rec in sufficient(read_incarnations(tier, job_id)):
                out.found.setdefault(rec.id, rec)
                out.records.setdefault(rec.id, rec.model_dump(mode="json"))
        except (TierError, OSError) as exc:
            unlisted(tier, exc)
    return out


def collect_inventory(
    tiers: Sequence[Tier], job_id: str, rank: int, world_size: int
) -> RankInventory:
    """List every tier (nearest first) for ``job_id``: one rank's :class:`RankInventory`.

    A tier that cannot be listed is noted and left out (restore falls back to the others).
    Steps whose manifests record another world size, or none readable (unknown format version,
    malformed), are noted and left out: they cannot be restored by this job as it runs.

    Incarnations: a RAM step is listed with the incarnation of this rank's shard; a
    shared tier's (PVC, GCS) step with a global commit record for every rank when the record
    verifies and this rank's shard there is the one it committed (else the step is unusable for
    this rank), and without a record for this rank alone, with its shard's incarnation (the
    plan only combines shards of one live incarnation). A shared tier's committed steps are
    those :func:`strata.tiers.eligible.tier_steps` calls eligible in the lineage of every
    record this rank found (a dead one is noted and left out); every record goes into the
    inventory too, so that the plan applies the lineage of all ranks' records together.
    A manifest that fails its seal or names another shard is a corrupt copy: it is quarantined
    there, so it is never listed again and never served.
    """
    committed: dict[str, dict[int, frozenset[int]]] = {}
    partial: dict[str, dict[int, frozenset[int]]] = {}
    incarnations: dict[str, dict[int, str]] = {}
    unusable: dict[str, frozenset[int]] = {}
    notes: list[str] = []
    listed = list_tiers(
        tiers, job_id, lambda tier, exc: notes.append(f"{tier.name}: not searched: {exc}")
    )
    listings, records, lin = listed.steps, listed.records, listed.lineage()
    for tier in tiers:
        if tier.name not in listings:
            continue
        listing = listings[tier.name]
        c: dict[int, frozenset[int]] = {}
        p: dict[int, frozenset[int]] = {}
        inc: dict[int, str] = {}
        bad: set[int] = set()
        local = tier.name in LOCAL_TIERS
        try:
            steps = (
                None
                if local
                else tier_steps(tier, job_id, lin, [s for s, e in listing.items() if e.has_commit])
            )
        except (TierError, OSError) as exc:
            notes.append(f"{tier.name}: not searched: {exc}")
            continue
        commits = steps.eligible if steps is not None else {}
        dead = steps.dead if steps is not None else {}
        for step, entry in listing.items():
            if entry.partial_ranks:
                p[step] = entry.partial_ranks
            if not entry.committed_ranks:
                continue
            if step in dead:
                notes.append(
                    f"{tier.name}: step {step} skipped: "
                    + lin.why_dead(dead[step].incarnation, step)
                )
                continue
            if not local and step in commits:
                why = _global_commit(tier, job_id, step, rank, world_size, commits[step])
                if isinstance(why, str):
                    notes.append(f"{tier.name}: step {step} skipped: {why}")
                    bad.add(step)
                else:
                    c[step] = frozenset(range(world_size))
                    inc[step] = why[0]
                continue
            if not local:
                # No commit record: this rank's own shard may still join shards of the same
                # incarnation from other tiers (the plan checks that every rank's is one).
                if rank not in entry.committed_ranks:
                    continue
                try:
                    m = tier.get_manifest(job_id, step, rank)
                except TierError as exc:
                    notes.append(f"{tier.name}: step {step} skipped: {exc}")
                    continue
                if m.world_size != world_size:
                    notes.append(
                        f"{tier.name}: step {step} was written with world size {m.world_size}, "
                        f"this job runs with {world_size}; {RESHARD_ONLY}"
                    )
                    continue
                c[step] = frozenset({rank})
                inc[step] = m.incarnation
                continue
            if rank in entry.committed_ranks:
                with contextlib.suppress(TierError):
                    inc[step] = tier.get_manifest(job_id, step, rank).incarnation
            if entry.world_size is None:
                notes.append(
                    f"{tier.name}: step {step} skipped: {_why_unreadable(tier, job_id, step, entry)}"
                )
            elif entry.world_size != world_size:
                notes.append(
                    f"{tier.name}: step {step} was written with world size {entry.world_size}, "
                    f"this job runs with {world_size}; {RESHARD_ONLY}"
                )
            else:
                c[step] = entry.committed_ranks
        committed[tier.name] = c
        partial[tier.name] = p
        incarnations[tier.name] = inc
        if bad:
            unusable[tier.name] = frozenset(bad)
    return RankInventory(
        rank,
        world_size,
        committed,
        partial,
        tuple(notes),
        incarnations=incarnations,
        unusable=unusable,
        records=tuple(records.values()),
    )


def _global_commit(
    tier: Tier, job_id: str, step: int, rank: int, world_size: int, commit: StepCommit | None
) -> tuple[str] | str:
    """(incarnation,) when ``step`` is complete in the shared ``tier`` for this job and this
    rank's shard is the committed one; else why not."""
    if commit is None:
        return "no global commit record (not every rank's shard of one incarnation is there)"
    if commit.archive_only:
        return "archive-only (it keeps only some components; never used to resume training)"
    if commit.world_size != world_size:
        return (
            f"it was written with world size {commit.world_size}, this job runs with "
            f"{world_size}; {RESHARD_ONLY}"
        )
    try:
        m, raw = read_manifest_raw(tier, job_id, step, rank)
    except TierError as exc:
        return f"rank {rank}: {exc}"
    if not commit.matches(m, raw):
        return (
            f"rank {rank}'s shard (incarnation {m.incarnation!r}, world size {m.world_size}, "
            f"crc32c {m.crc32c}) is not the one its commit record names (incarnation "
            f"{commit.incarnation!r}, world size {commit.world_size}); it was replaced"
        )
    return (commit.incarnation,)


def _why_unreadable(tier: Tier, job_id: str, step: int, entry: StepListing) -> str:
    why: list[str] = []
    for rank in sorted(entry.committed_ranks):
        try:
            tier.get_manifest(job_id, step, rank)
        except ShardCorrupt as exc:
            try:
                tier.quarantine(job_id, step, rank, str(exc))
                why.append(f"{exc} (quarantined)")
            except TierError as qexc:
                why.append(f"{exc} (quarantine failed: {qexc})")
        except TierError as exc:
            why.append(str(exc))
    return "; ".join(why) or "no readable manifest (malformed or written by another Strata version)"
