"""``strata verify``: a checkpoint fsck. Every committed copy of every (or one) step in every
location is re-read in full and checked against its manifest (length, every chunk's CRC32C, the
whole object's CRC32C) through :meth:`strata.tiers.base.Tier.verify_shard`.

Read-only: a bad copy is reported, never quarantined (a restore does that when it meets it).
Statuses of one copy: ``ok``; ``corrupt`` (checksum mismatch, truncated, data missing under a
manifest, a malformed manifest); ``unreadable`` (a manifest this Strata cannot read: another
format version or job, permissions); ``unchecked`` (a RAM copy whose checksums are not computed
yet, its writer is still running); ``partial`` (data without a manifest: never committed, not a
bad copy). Any ``corrupt`` or ``unreadable`` copy makes the run fail. Each step's global commit record
(``commit.json`` in the PVC and GCS tiers) is checked too (:func:`commit_rows`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strata.cli.locations import Location, NotFound
from strata.cli.output import Advance
from strata.errors import CommitError, ShardCorrupt, TierError
from strata.tiers.records import read_commit, verify_commit
from strata.tiers.references import verify_following_refs

BAD = frozenset({"corrupt", "unreadable"})


@dataclass
class Target:
    loc: Location
    job: str
    step: int
    rank: int
    nbytes: int | None
    """From the manifest (None: not readable; still checked)."""
    committed: bool


def targets(locations: Sequence[Location], jobs: Sequence[str], step: int | None) -> list[Target]:
    """Every copy to check, in a stable order; :class:`NotFound` when there is none."""
    out: list[Target] = []
    for loc in locations:
        for job in jobs:
            for s, listing in sorted(loc.tier.list_steps(job).items()):
                if step is not None and s != step:
                    continue
                for r in sorted(listing.committed_ranks | listing.partial_ranks):
                    committed = r in listing.committed_ranks
                    nbytes = None
                    if committed:
                        with contextlib.suppress(TierError):
                            nbytes = loc.tier.get_manifest(job, s, r).data_nbytes
                    out.append(Target(loc, job, s, r, nbytes, committed))
    if not out:
        what = f"step {step} of " if step is not None else ""
        raise NotFound(
            f"{what}job(s) {', '.join(jobs) or '(none)'}: nothing found in "
            f"{', '.join(loc.spec for loc in locations)}; `strata list` shows what is there"
        )
    return out


def check(t: Target) -> dict[str, Any]:
    """Verify one copy; a row for the report."""
    row: dict[str, Any] = {
        "tier": t.loc.kind,
        "location": t.loc.spec,
        "job": t.job,
        "step": t.step,
        "rank": t.rank,
        "bytes": t.nbytes,
    }
    if not t.committed:
        return {**row, "status": "partial", "detail": "data without a manifest (never committed)"}
    try:
        m = t.loc.tier.get_manifest(t.job, t.step, t.rank)
        if not m.verified:
            return {
                **row,
                "status": "unchecked",
                "detail": "no checksums recorded yet (its writer is computing them)",
            }
        verify_following_refs(t.loc.tier, t.job, t.step, t.rank)
    except ShardCorrupt as exc:
        return {**row, "status": "corrupt", "detail": str(exc)}
    except TierError as exc:
        return {**row, "status": "unreadable", "detail": str(exc)}
    return {**row, "status": "ok", "detail": ""}


def commit_rows(
    locations: Sequence[Location], jobs: Sequence[str], step: int | None
) -> list[dict[str, Any]]:
    """One row per global commit record (``commit.json``) in the given steps: ``ok``
    when it verifies (its seal) and names exactly the shards next to it; ``corrupt`` when torn,
    of another step, or naming a shard that was replaced; ``unreadable`` when it cannot be read.
    Empty where no step has a commit record."""
    rows = []
    for loc in locations:
        for job in jobs:
            for s, listing in sorted(loc.tier.list_steps(job).items()):
                if (step is not None and s != step) or not listing.has_commit:
                    continue
                row: dict[str, Any] = {
                    "tier": loc.kind,
                    "location": loc.spec,
                    "job": job,
                    "step": s,
                    "rank": None,
                    "bytes": None,
                    "object": "commit.json",
                }
                try:
                    commit = read_commit(loc.tier, job, s)
                    problems = (
                        verify_commit(loc.tier, commit)
                        if commit is not None
                        else ["it vanished while listing"]
                    )
                except CommitError as exc:
                    rows.append({**row, "status": "corrupt", "detail": f"commit record: {exc}"})
                    continue
                except TierError as exc:
                    rows.append({**row, "status": "unreadable", "detail": f"commit record: {exc}"})
                    continue
                if problems:
                    detail = "commit record does not match its shards: " + "; ".join(problems)
                    rows.append({**row, "status": "corrupt", "detail": detail})
                else:
                    rows.append({**row, "status": "ok", "detail": "commit record"})
    return rows


def verify_all(ts: Sequence[Target], advance: Advance) -> list[dict[str, Any]]:
    rows = []
    for t in ts:
        rows.append(check(t))
        advance(t.nbytes or 0, f"{t.loc.kind} step {t.step} rank {t.rank}")
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    steps = {(r["location"], r["job"], r["step"]) for r in rows}
    bad_steps = sorted({(r["location"], r["job"], r["step"]) for r in rows if r["status"] in BAD})
    return {
        "copies": len(rows),
        "steps": len(steps),
        "bytes_checked": sum(r["bytes"] or 0 for r in rows if r["status"] in {"ok", "corrupt"}),
        "by_status": counts,
        "bad": sum(counts.get(s, 0) for s in BAD),
        "bad_steps": [{"location": loc, "job": j, "step": s} for loc, j, s in bad_steps],
    }
