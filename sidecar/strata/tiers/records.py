"""Global commit records and incarnation records in a tier, through the Tier contract.

- :func:`commit_if_complete`: the step's global commit record, written when every rank's shard of
  one incarnation is committed in the tier (conditional create: ``O_EXCL`` + ``link`` on POSIX,
  ``if_generation_match=0`` on GCS). Idempotent: a record already there that commits the same
  shards is accepted; any other is an error (:class:`CommitError`).
- :func:`committed_steps`: the steps of a tier with a commit record that verifies (seal), by step.
- :func:`verify_commit`: the record still describes the shards next to it (each rank's manifest
  bytes and data checksum are the ones committed).
- :func:`read_incarnations` / :func:`write_incarnation`: ``<job>/incarnations/<id>.json``.
  A job gains a record at every restore; both cost one listing plus the records not seen
  before: records are created once and never rewritten (sealed), and each :class:`Tier` object
  keeps those it read. Before, every inventory read every record and every commit re-created
  every record of the chain (on GCS: one request each; a long chaos run, ~600 restores, went
  from 0.13 s to 2.6 s per restore).
- :func:`collect_incarnations`: a record carries its whole chain (``ancestors``), so once the
  newest record does, the older ones are redundant; a tier keeps the newest
  :data:`KEEP_INCARNATION_RECORDS` and deletes the rest (after each commit there, and on the
  node's RAM tier when the sidecar reads it), so a job restored a thousand times reads a few
  records per tier, not a thousand.

Who writes what and what happens when a writer dies at each point: docs/architecture.md
"Global commit and incarnations".
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable

from strata.errors import CommitError, ShardUnavailable, TierError
from strata.format import layout
from strata.format.commit import StepCommit, build_commit
from strata.format.incarnation import Incarnation, Lineage
from strata.format.manifest import Manifest
from strata.tiers.base import Tier, parse_manifest

log = logging.getLogger("strata.records")


def read_manifest_raw(tier: Tier, job_id: str, step: int, rank: int) -> tuple[Manifest, bytes]:
    """A committed manifest with its stored bytes. :class:`ShardUnavailable` when absent,
    :class:`ShardCorrupt` when malformed (as :meth:`Tier.get_manifest`)."""
    key = layout.manifest_key(job_id, step, rank)
    raw = tier.read_record(key)
    if raw is None:
        raise ShardUnavailable(f"{tier.name}:{key}: not committed")
    return parse_manifest(raw, f"{tier.name}:{key}", job_id, step, rank), raw


def read_commit(tier: Tier, job_id: str, step: int) -> StepCommit | None:
    """The step's commit record in ``tier``; None when absent. :class:`CommitError` when it is
    torn, corrupt or another step's; :class:`TierError` when the tier cannot be read."""
    key = layout.commit_key(job_id, step)
    raw = tier.read_record(key)
    if raw is None:
        return None
    c = StepCommit.from_bytes(raw, f"{tier.name}:{key}")
    c.check_identity(job_id, step)
    return c


def committed_steps(
    tier: Tier, job_id: str, steps: Iterable[int] | None = None
) -> dict[int, StepCommit]:
    """Steps of ``tier`` whose commit record verifies (its seal) and whose every rank still has
    a committed manifest next to it (not yet checked against the shards' bytes).

    ``steps``: only these (default: every step of :meth:`Tier.step_numbers`; one read of each
    step's record and one listing of each step with a record: the cost is the number of steps,
    never the number of shards). A bad record, or a stale one whose shards are gone (retention
    deleted the step while another sidecar committed it), is logged and left out (the step is
    then not complete there). :class:`TierError` when the tier cannot be listed.
    """
    if steps is None:
        steps = tier.step_numbers(job_id)
    out: dict[int, StepCommit] = {}
    for step in steps:
        try:
            c = read_commit(tier, job_id, step)
        except CommitError as exc:
            log.warning("step %d is not complete in the %s tier: %s", step, tier.name, exc)
            continue
        if c is None:
            continue
        listing = tier.list_step(job_id, step)
        held = listing.committed_ranks if listing is not None else frozenset()
        if not set(range(c.world_size)) <= held:
            log.warning(
                "step %d is not complete in the %s tier: its commit record is stale (ranks %s "
                "of %d have no committed shard)",
                step,
                tier.name,
                sorted(set(range(c.world_size)) - held),
                c.world_size,
                extra={"event": "stale_commit", "tier": tier.name, "step": step},
            )
            continue
        out[step] = c
    return out


def verify_commit(tier: Tier, commit: StepCommit) -> list[str]:
    """Problems with ``commit`` against the shards next to it in ``tier`` (empty: it holds)."""
    problems = []
    for rank in range(commit.world_size):
        try:
            m, raw = read_manifest_raw(tier, commit.job_id, commit.step, rank)
        except TierError as exc:
            problems.append(f"rank {rank}: {exc}")
            continue
        if not commit.matches(m, raw):
            problems.append(
                f"rank {rank}: the shard there (incarnation {m.incarnation!r}, crc32c "
                f"{m.crc32c}) is not the one committed (incarnation {commit.incarnation!r})"
            )
    return problems


def commit_if_complete(
    tier: Tier,
    job_id: str,
    step: int,
    writer_id: str,
    incarnation: str | None = None,
    records: Iterable[Incarnation] = (),
) -> StepCommit | None:
    """Write the step's commit record if every rank's shard of one incarnation is committed.

    ``incarnation``: only commit shards of that incarnation. ``records``: incarnation records to
    make sure the tier holds first (the committing incarnation's lineage), so that a reader of
    this tier alone can tell live steps from superseded ones.
    Returns the record now in the tier (written by this call or an earlier writer), or None
    when the step is not complete there (a rank missing, or shards of another incarnation).
    Raises :class:`CommitError` when a different record is already there, :class:`TierError`
    (:class:`TierFull`) when the tier fails; nothing partial is ever left visible.
    """
    listing = tier.list_step(job_id, step)  # that step alone, never the whole job
    if listing is None or not listing.committed_ranks or listing.world_size is None:
        return None
    if not set(range(listing.world_size)) <= listing.committed_ranks:
        return None
    shards: dict[int, tuple[Manifest, bytes]] = {}
    for rank in range(listing.world_size):
        try:
            shards[rank] = read_manifest_raw(tier, job_id, step, rank)
        except ShardUnavailable:
            return None
    try:
        commit = build_commit(job_id, step, shards, writer_id, incarnation)
    except CommitError as exc:
        log.info("step %d not committable in the %s tier yet: %s", step, tier.name, exc)
        return None
    held = _write_missing(tier, job_id, records)
    written = write_commit(tier, commit)
    if held > KEEP_INCARNATION_RECORDS:  # else nothing to collect: no second listing
        try:
            collect_incarnations(tier, job_id)
        except TierError as exc:  # the commit stands; the next one collects
            log.info("incarnation records of %s not collected: %s", tier.name, exc)
    return written


def write_commit(tier: Tier, commit: StepCommit) -> StepCommit:
    """Create the commit record unless one is there; returns the record in the tier.

    An existing record that commits the same shards is accepted (another sidecar got there
    first). A torn or corrupt one (its writer died mid-write on a medium without atomic
    create, or it rotted) is replaced once the shards verify against the new record, and so is a
    stale one (the shards it names are gone or replaced) when the shards verify against the new
    record. Any other record raises :class:`CommitError`.
    """
    key = layout.commit_key(commit.job_id, commit.step)
    if tier.create_record(key, commit.to_bytes()):
        log.info(
            "committed step %d in the %s tier (incarnation %s, world size %d)",
            commit.step,
            tier.name,
            commit.incarnation,
            commit.world_size,
            extra={"event": "step_committed", "tier": tier.name, "step": commit.step},
        )
        return commit
    try:
        existing = read_commit(tier, commit.job_id, commit.step)
    except CommitError as exc:
        log.warning("replacing a bad commit record in the %s tier: %s", tier.name, exc)
        tier.delete_record(key)
        if tier.create_record(key, commit.to_bytes()):
            return commit
        existing = read_commit(tier, commit.job_id, commit.step)
    if existing is None:  # deleted meanwhile (retention): the step is going away
        raise CommitError(f"{tier.name}:{key} vanished while being committed")
    if not existing.same_commit(commit) and verify_commit(tier, existing):
        # Stale: the shards it commits are gone or replaced (it outlived a deletion that raced
        # its writer), so no reader can use it; the shards there now are the ones to commit.
        log.warning(
            "replacing a stale commit record in the %s tier (incarnation %r): %s",
            tier.name,
            existing.incarnation,
            "; ".join(verify_commit(tier, existing)),
            extra={"event": "stale_commit", "tier": tier.name, "step": commit.step},
        )
        if not verify_commit(tier, commit):
            tier.delete_record(key)
            if tier.create_record(key, commit.to_bytes()):
                return commit
            existing = read_commit(tier, commit.job_id, commit.step)
            if existing is None:
                raise CommitError(f"{tier.name}:{key} vanished while being committed")
    if not existing.same_commit(commit):
        raise CommitError(
            f"{tier.name}:{key} already commits other shards (incarnation "
            f"{existing.incarnation!r}, world size {existing.world_size}); un-commit that step "
            "before committing it again"
        )
    return existing


_READ: weakref.WeakKeyDictionary[Tier, dict[tuple[str, str], Incarnation]] = (
    weakref.WeakKeyDictionary()
)
"""Per tier object: (job id, record name) -> the record read there (records are create-only)."""
_READ_LOCK = threading.Lock()


def _cache(tier: Tier) -> dict[tuple[str, str], Incarnation]:
    with _READ_LOCK:
        try:
            return _READ.setdefault(tier, {})
        except TypeError:  # an unhashable tier: no cache
            return {}


def read_incarnations(tier: Tier, job_id: str) -> list[Incarnation]:
    """Every readable incarnation record of ``job_id`` in ``tier`` (bad ones logged, skipped).

    One listing, then a read of each record this ``tier`` object has not read before (a record
    is created once, sealed, and never rewritten; a record deleted since is no longer listed and
    no longer returned). :class:`TierError` when the tier cannot be listed or read."""
    out = []
    prefix = layout.incarnations_prefix(job_id)
    cache = _cache(tier)
    for name in tier.list_records(prefix):
        inc = layout.parse_incarnation_name(name)
        if inc is None:
            continue
        known = cache.get((job_id, name))
        if known is not None:
            out.append(known)
            continue
        raw = tier.read_record(f"{prefix}/{name}")
        if raw is None:
            continue
        try:
            rec = Incarnation.from_bytes(raw, f"{tier.name}:{prefix}/{name}")
        except CommitError as exc:
            log.warning("ignoring incarnation record: %s", exc)
            continue
        if rec.id == inc and rec.job_id == job_id:
            cache[(job_id, name)] = rec
            out.append(rec)
    return out


KEEP_INCARNATION_RECORDS = 16
"""Incarnation records a tier keeps per job (the newest, by creation time then id) once the
newest carries its chain. More than one: a restore that read the records just before a newer
one appeared still finds the ones it read (any of them gives it the whole chain)."""


def collect_incarnations(tier: Tier, job_id: str, keep: int = KEEP_INCARNATION_RECORDS) -> int:
    """Delete ``job_id``'s incarnation records in ``tier`` beyond the newest ``keep`` (by
    ``created``, then id), when the newest carries its chain (``ancestors`` set: the lineage
    follows from it alone, so the others change no step's liveness). Nothing is deleted while
    the newest record is of the older kind (its chain is walked through the parents' records).
    Returns how many were deleted. :class:`TierError` when the tier cannot be listed or read;
    a record that cannot be deleted is logged and left for the next call."""
    recs = read_incarnations(tier, job_id)
    if len(recs) <= keep:
        return 0
    ordered = sorted(recs, key=lambda r: (r.created, r.id), reverse=True)
    if ordered[0].ancestors is None:
        return 0
    cache = _cache(tier)
    deleted = 0
    for rec in ordered[keep:]:
        key = layout.incarnation_key(job_id, rec.id)
        try:
            tier.delete_record(key)
        except TierError as exc:
            log.info("incarnation record %s not collected from %s: %s", rec.id, tier.name, exc)
            continue
        cache.pop((job_id, key.rsplit("/", 1)[-1]), None)
        deleted += 1
    if deleted:
        log.info(
            "collected %d incarnation records of job %s from the %s tier (the newest, %s, "
            "carries the chain)",
            deleted,
            job_id,
            tier.name,
            ordered[0].id,
            extra={"event": "incarnations_collected", "tier": tier.name, "count": deleted},
        )
    return deleted


def write_missing_incarnations(tier: Tier, job_id: str, records: Iterable[Incarnation]) -> int:
    """Create those of ``records`` (of ``job_id``) that ``tier`` does not list: one listing,
    then one create each for the missing ones (a listed name is never rewritten, as
    :func:`write_incarnation` would not either). Returns how many this call created.
    :class:`TierError` (:class:`TierFull`) when the tier fails."""
    listed = set(tier.list_records(layout.incarnations_prefix(job_id)))
    return _create_unlisted(tier, job_id, records, listed)


def _write_missing(tier: Tier, job_id: str, records: Iterable[Incarnation]) -> int:
    """:func:`write_missing_incarnations` for a commit: returns how many records the tier
    holds now (listed plus created), from its one listing."""
    listed = set(tier.list_records(layout.incarnations_prefix(job_id)))
    return len(listed) + _create_unlisted(tier, job_id, records, listed)


def _create_unlisted(
    tier: Tier, job_id: str, records: Iterable[Incarnation], listed: set[str]
) -> int:
    created = 0
    for rec in records:
        if rec.job_id != job_id:
            continue
        if layout.incarnation_key(job_id, rec.id).rsplit("/", 1)[-1] in listed:
            continue
        created += write_incarnation(tier, rec)
    return created


def write_incarnation(tier: Tier, rec: Incarnation) -> bool:
    """Create ``rec`` in ``tier`` unless it is there; True when this call created it."""
    return tier.create_record(layout.incarnation_key(rec.job_id, rec.id), rec.to_bytes())


def lineage(
    tiers: Iterable[Tier],
    job_id: str,
    current: str | None = None,
    extra: Iterable[Incarnation] = (),
) -> Lineage:
    """:class:`Lineage` from the records of every tier that can be read (others skipped)."""
    recs: dict[str, Incarnation] = {r.id: r for r in extra}
    for tier in tiers:
        try:
            for r in read_incarnations(tier, job_id):
                recs.setdefault(r.id, r)
        except TierError as exc:
            log.info("incarnation records of %s not read: %s", tier.name, exc)
    return Lineage(recs.values(), current)
