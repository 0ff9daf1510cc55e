"""Start-up pruning of the RAM tier (C-12): keep only the newest committed step of each rank.

A sidecar that starts (again) finds what the previous pod incarnation left in the RAM directory:
older committed steps, partial steps (data links without a manifest, left by a writer killed
mid-save or OOM-killed), stray temporary manifests, and slot rings that grew while promotion held
slots. :func:`prune_ram` removes all of it, so the ring is back to ``keep + 1`` slots per rank.
"""

from __future__ import annotations

import fcntl
import logging
import os

from strata.restore.staging import remove_stale_first_slots
from strata.tiers.ram import RamTier
from strata.tiers.slots import identity_of, path_identity, remove_slot_if_unused, slots_dir

log = logging.getLogger("strata.promotion")


def prune_ram(ram: RamTier, job_id: str, keep: int) -> list[tuple[int, int]]:
    """Keep only the newest committed RAM step of each rank of ``job_id``; drop everything else.

    Removes older committed steps, partial steps and stray temporary manifests, and shrinks
    each rank's slot ring back to ``keep + 1`` free-or-used slots. Returns the (step, rank)
    pairs removed. Only this job's directory is touched (hostPath medium).
    """
    removed: list[tuple[int, int]] = []
    listings = ram.list_steps(job_id)
    ranks: set[int] = set()
    for listing in listings.values():
        ranks.update(listing.committed_ranks | listing.partial_ranks)
    for rank in sorted(ranks):
        committed = [s for s, li in listings.items() if rank in li.committed_ranks]
        newest = max(committed) if committed else None
        for step, listing in sorted(listings.items()):
            if step == newest or rank not in (listing.committed_ranks | listing.partial_ranks):
                continue
            was_committed = rank in listing.committed_ranks
            if _uncommit_unless_in_use(ram, job_id, step, rank, was_committed):
                removed.append((step, rank))
    for step in listings:
        d = ram.step_dir(job_id, step)
        try:
            for entry in os.scandir(d):
                if ".tmp-" in entry.name:
                    os.unlink(entry.path)
            d.rmdir()
        except OSError:
            pass
    shrink_slot_rings(ram, job_id, keep)
    if removed:
        log.info(
            "start-up: pruned %d RAM shards to the newest committed step per rank",
            len(removed),
            extra={"event": "ram_pruned", "removed": removed},
        )
    return removed


def _uncommit_unless_in_use(
    ram: RamTier, job_id: str, step: int, rank: int, was_committed: bool
) -> bool:
    """Un-commit a shard only while holding ``LOCK_EX`` on its data (no writer mid-commit, no
    reader), re-checking under the lock that it is still as listed (a partial step that a live
    writer committed meanwhile is kept); True if removed."""
    data = ram.data_path(job_id, step, rank)
    try:
        fd = os.open(data, os.O_RDONLY)
    except FileNotFoundError:
        # A manifest without data, or leftovers: nothing can be writing through it.
        ram.uncommit(job_id, step, rank)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("start-up: RAM step %d rank %d is in use; left alone", step, rank)
            return False
        if path_identity(data) != identity_of(os.fstat(fd)):
            return False
        if not was_committed and ram.manifest_path(job_id, step, rank).exists():
            return False
        ram.uncommit(job_id, step, rank)
        return True
    finally:
        os.close(fd)


def shrink_slot_rings(ram: RamTier, job_id: str, keep: int) -> None:
    """Release free slots beyond ``keep + 1`` per rank (highest slot names first).

    A slot is deleted only when nobody writes, reads or maps it
    (:func:`strata.tiers.slots.remove_slot_if_unused`): a trainer that kept running while its
    sidecar restarted keeps every slot it maps.
    """
    for rank in ram.slot_ranks(job_id):
        for path in remove_stale_first_slots(slots_dir(ram.root, job_id, rank)):
            log.info("start-up: removed unfinished staging slot %s", path)
        states = ram.slot_states(job_id, rank)
        free = [s for s in states if not s.steps]
        extra = len(states) - (keep + 1)
        for s in sorted(free, key=lambda s: s.path.name, reverse=True):
            if extra <= 0:
                break
            try:
                gone = remove_slot_if_unused(s.path)
            except OSError:
                continue
            if gone:
                extra -= 1
                log.info("start-up: removed surplus RAM slot %s", s.path)
            else:
                log.info("start-up: surplus RAM slot %s is in use (mapped); kept", s.path)
