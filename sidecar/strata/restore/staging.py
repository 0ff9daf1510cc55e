"""Staging: getting one rank's shard of a planned step into the RAM tier, verified.

:func:`stage_into_ram` is the ONE routine that does it, used by the trainer without a sidecar
(:class:`strata.client.LocalStager`) and by the sidecar's local API
(``POST /v1/stage``): the nearest tier that serves (:func:`stage_shard`), copied into a RAM slot
under the slot's write lock and committed in the RAM tier so that the next restore is a RAM hit.
Tiers are used only through the :class:`strata.tiers.base.Tier` contract.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from strata import faults
from strata.errors import ShardCorrupt, ShardUnavailable, StageError, TierError, TierFull
from strata.format import layout
from strata.format.incremental import logical_nbytes
from strata.format.manifest import Manifest
from strata.tiers.base import Tier
from strata.tiers.posix_io import remove_quietly
from strata.tiers.ram import RamTier
from strata.tiers.references import fetch_full
from strata.tiers.slots import (
    SlotProvider,
    SlotWriteLock,
    identity_of,
    path_identity,
    slot_size_for,
    slots_dir,
)


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
    quarantined: list[str] = field(default_factory=list)
    """Tiers whose copy failed verification and was quarantined on the way (for metrics)."""
    deferred_verify: bool = False
    """True: a RAM hit served in place and NOT verified here (``verify_in_place=False``); whoever
    loads ``path`` must verify it while loading (:mod:`strata.client.loader`)."""


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
    verify_in_place: bool | None = None,
) -> StageResult:
    """Get rank ``rank``'s shard of ``step`` from the nearest tier of ``tiers`` that verifies.

    ``verify_in_place``: whether a shard served in place is verified here (None: ``verify``);
    False when the caller verifies it while loading it (:mod:`strata.client.loader`: one pass;
    the result's ``deferred_verify`` then says so).

    - a tier that serves in place (:meth:`Tier.read_in_place`; the RAM tier) is verified where
      it lies (a shard whose writer died before its checksum pass is checksummed now; noted in
      ``skipped``); ``path`` is that tier's data file.
    - any other tier: ``fetch_shard`` into ``slot_path`` (verified while copying); an
      incremental copy is reassembled with its base's chunks (:func:`fetch_full`, always
      verified) and the full manifest is returned.
    - ``ShardCorrupt`` (checksum mismatch, truncation, a manifest naming another shard):
      that copy is quarantined and the next tier is tried. ``ShardUnavailable`` / other
      ``TierError`` (missing, another job or version or world size, unreachable): noted, next.

    Each tier is tried once. Raises :class:`StageError` (listing every tier searched and why)
    when none serves; the caller re-plans without ``step``.
    """
    skipped: list[str] = []
    quarantined: list[str] = []
    in_place = verify if verify_in_place is None else verify_in_place
    for tier in tiers:
        t0 = time.perf_counter()
        try:
            hit = tier.read_in_place(job_id, step, rank, world_size=world_size, verify=in_place)
            if hit is not None:
                m, path = hit.manifest, hit.path
                skipped.extend(hit.notes)
            else:
                m = tier.get_manifest(job_id, step, rank)
                _check_world(m, world_size, tier)
                _check_resumable(m, tier)
                n = logical_nbytes(m)
                path = slot_path(n) if callable(slot_path) else Path(slot_path)
                if m.refs is not None:  # an incremental copy: its base's chunks too
                    m = fetch_full(tier, job_id, step, rank, m, path)
                else:
                    m = tier.fetch_shard(job_id, step, rank, path, verify=verify)
                _check_world(m, world_size, tier)
        except ShardCorrupt as exc:
            skipped.append(f"{tier.name}: {exc} (quarantined)")
            quarantined.append(tier.name)
            try:
                tier.quarantine(job_id, step, rank, str(exc))
            except TierError as qexc:
                skipped.append(f"{tier.name}: quarantine failed: {qexc}")
            continue
        except (TierError, OSError) as exc:
            skipped.append(f"{tier.name}: {exc}")
            continue
        return StageResult(
            tier.name,
            path,
            m,
            m.data_nbytes,
            time.perf_counter() - t0,
            skipped,
            quarantined,
            deferred_verify=hit is not None and verify and not in_place,
        )
    searched = ", ".join(f"{t.name}" for t in tiers) or "no tiers"
    raise StageError(
        f"no tier could serve rank {rank} of step {step} of job {job_id!r} (searched {searched}): "
        + "; ".join(skipped),
        skipped,
        quarantined,
    )


def _check_resumable(m: Manifest, tier: Tier) -> None:
    if m.components is not None:
        raise ShardUnavailable(
            f"{tier.name}: step {m.step} rank {m.rank} is archive-only (it holds only "
            f"{m.components}); it is never used to resume training (use `strata export`)"
        )


def _check_world(m: Manifest, world_size: int | None, tier: Tier) -> None:
    if world_size is not None and m.world_size != world_size:
        raise ShardUnavailable(
            f"{tier.name}: step {m.step} rank {m.rank} was written with world size "
            f"{m.world_size}, this job runs with {world_size}"
        )


def stage_into_ram(
    tiers: Sequence[Tier],
    ram: RamTier,
    slots: SlotProvider,
    job_id: str,
    step: int,
    rank: int,
    *,
    world_size: int,
    verify: bool = True,
    sources: Sequence[str] | None = None,
    before_allocate: Callable[[int], None] | None = None,
    verify_in_place: bool | None = None,
) -> StageResult:
    """Put rank ``rank``'s shard of ``step`` into the RAM tier ``ram``, committed there.

    ``tiers``: every tier, nearest first; ``sources``: the names to try (the plan's sources for
    this rank; None: all). A shard another tier serves is copied into a slot from ``slots``
    (held under :class:`SlotWriteLock` while it is written and committed, released after);
    into a rank without slots (a new pod's empty RAM tier) the copy goes into one slot created
    sparse and filled as it is written (:func:`first_slot`), not into a ring allocated first.
    ``before_allocate(nbytes)``: called before a slot is taken (the sidecar refuses a slot ring
    that would not fit its size limit there). ``verify_in_place``: see :func:`stage_shard`.
    The result's ``path`` is the RAM data file.
    Raises :class:`StageError` when no tier serves, :class:`TierError` (e.g. ``TierFull``,
    ``SlotsBusy``) when the RAM tier cannot take the copy.
    """
    locks: list[SlotWriteLock] = []
    fresh: list[SlotWriteLock] = []  # a first slot created for this copy (at most one)

    def slot_for(nbytes: int) -> Path:
        if fresh and os.fstat(fresh[0].fd).st_size >= nbytes:
            return fresh[0].path  # a nearer tier failed mid-copy: the next one overwrites it
        if before_allocate is not None:
            before_allocate(nbytes)
        lock = None if fresh else first_slot(ram.root, job_id, rank, nbytes)
        if lock is not None:
            fresh.append(lock)
        else:
            lock = SlotWriteLock.acquire(slots, job_id, rank, nbytes)
        locks.append(lock)
        return lock.path

    try:
        chosen = [t for t in tiers if sources is None or t.name in sources]
        res = stage_shard(
            chosen,
            job_id,
            step,
            rank,
            slot_for,
            world_size=world_size,
            verify=verify,
            verify_in_place=verify_in_place,
        )
        if res.tier != ram.name:
            faults.point("stage.copied")
            if fresh and fresh[0].path == res.path:
                res.path = seal_first_slot(fresh.pop())
            expect = next((lk.identity for lk in locks if lk.path == res.path), None)
            ram.commit_slot(job_id, step, rank, res.path, res.manifest, expect=expect)
            res.path = ram.data_path(job_id, step, rank)
        return res
    finally:
        for lock in fresh:  # not sealed: the copy failed
            remove_quietly(lock.path)
        for lock in locks:
            lock.release()


STAGING_PREFIX = ".staging-"
"""Name prefix of a first slot while a staging copy fills it (never a slot of the ring)."""


def first_slot(root: Path, job_id: str, rank: int, nbytes: int) -> SlotWriteLock | None:
    """A slot for a staging copy into a rank that has no slot yet (a new pod's empty RAM tier),
    locked; None when the rank has slots (or another writer is creating this one).

    Created sparse, under a temporary name, so that the copy allocates its pages as it writes
    them: the provider would first allocate the whole ring (``ram.keep + 1`` slots, every page
    zero-filled: 0.27 s for two 426 MB slots here, more than a ``cp`` of the shard), and the
    copy would then write every page again. :func:`seal_first_slot` allocates the rest and
    names it a slot; the saver allocates the rest of the ring in the background after the
    restore. A temporary file left by a killed stager is removed here (it is never a slot).
    """
    d = slots_dir(root, job_id, rank)
    d.mkdir(parents=True, exist_ok=True)
    remove_stale_first_slots(d)
    with os.scandir(d) as it:  # closed even when any() stops early
        if any(layout.parse_slot(e.name) is not None for e in it):
            return None
    path = d / f"{STAGING_PREFIX}{layout.slot_name(0)}"
    # Created unnamed, locked, then linked under its name: a file named but not yet locked
    # looks exactly like a killed stager's, and a concurrent remove_stale_first_slots (another
    # staging of this rank, start-up pruning) removed it; this stager then named another
    # stager's file (created at the freed name meanwhile) a slot of the ring.
    try:
        fd = os.open(d, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:  # no O_TMPFILE on this filesystem: the slot stays with the ring's provider
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, slot_size_for(nbytes))
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:  # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names the unnamed file
            os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=dfd, follow_symlinks=True)
        finally:
            os.close(dfd)
    except OSError:  # FileExistsError: another stager is creating it
        os.close(fd)
        return None
    return SlotWriteLock(path, fd)


def remove_stale_first_slots(d: Path) -> list[Path]:
    """Remove the temporary first slots (:func:`first_slot`) in the slot directory ``d`` that
    no live stager holds (left by a stager killed mid-copy); the paths removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(STAGING_PREFIX):
            fd = _try_exclusive(Path(entry.path))
            if fd is None:
                continue
            try:
                # Still the file locked (not removed by another scanner and a live stager's
                # created at the name meanwhile): no live stager holds it.
                if path_identity(Path(entry.path)) == identity_of(os.fstat(fd)):
                    remove_quietly(Path(entry.path))
                    removed.append(Path(entry.path))
            finally:
                os.close(fd)
    return removed


def seal_first_slot(lock: SlotWriteLock) -> Path:
    """Allocate every page of the slot ``lock`` holds (the copy allocated those it wrote) and
    give it a slot name of the ring; the new path (``lock.path`` follows it). Raises
    :class:`TierFull` when the RAM tier cannot hold the rest (the file is removed)."""
    size = os.fstat(lock.fd).st_size
    try:
        os.posix_fallocate(lock.fd, 0, size)
    except OSError as exc:
        remove_quietly(lock.path)
        raise TierFull(
            f"no space left on the RAM tier for a {size}-byte slot {lock.path}; raise the RAM "
            "tier size limit (emptyDir sizeLimit) or lower ram.keep"
        ) from exc
    k = 0
    while True:
        final = lock.path.parent / layout.slot_name(k)
        try:
            os.link(lock.path, final)  # never replaces a slot created meanwhile
            break
        except FileExistsError:
            k += 1
    os.unlink(lock.path)
    lock.path = final
    return final


def _try_exclusive(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
