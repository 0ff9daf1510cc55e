"""Start-up pruning of the RAM tier (C-12): keep only the newest committed step of each rank.

A sidecar that starts (again) finds what the previous pod incarnation left in the RAM directory:
older committed steps, partial steps (data links without a manifest, left by a writer killed
mid-save or OOM-killed), stray temporary manifests, and slot rings that grew while promotion held
slots. :func:`prune_ram` removes all of it, so the ring is back to ``keep + 1`` slots per rank.
"""

from __future__ import annotations

import logging
import os

from strata.tiers.ram import RamTier

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
            ram.uncommit(job_id, step, rank)
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


def shrink_slot_rings(ram: RamTier, job_id: str, keep: int) -> None:
    """Release free slots beyond ``keep + 1`` per rank (highest slot names first)."""
    for rank in ram.slot_ranks(job_id):
        states = ram.slot_states(job_id, rank)
        free = [s for s in states if not s.steps]
        extra = len(states) - (keep + 1)
        for s in sorted(free, key=lambda s: s.path.name, reverse=True)[: max(0, extra)]:
            try:
                s.path.unlink()
            except OSError:
                continue
            log.info("start-up: removed surplus RAM slot %s", s.path)
