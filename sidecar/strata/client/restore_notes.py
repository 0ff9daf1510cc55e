"""What a restore tells its caller besides the step: notes and quarantined copies.

Kept apart from the collective protocol (:mod:`strata.client.collectives`): nothing here is
gathered, and nothing here decides what a rank does next. :class:`RestoreNotes` collects the
notes that end in ``RestoreResult.skipped`` (partial steps, quarantined copies, other world
sizes, tiers down) and the tiers whose copy this rank quarantined while loading (reported in
the :class:`strata.protocol.RestoreEvent`); :func:`searched` names the tiers a failed restore
searched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from strata.config import StrataConfig
from strata.errors import ShardCorrupt, TierError
from strata.tiers.base import Tier
from strata.tiers.ram import RamTier

log = logging.getLogger("strata.client")


class RestoreNotes:
    """The notes of one restore, in order (``items``, the result's ``skipped``), and the tiers
    whose copy this rank's loads found corrupt (``quarantined``)."""

    def __init__(self, initial: Iterable[str] = ()) -> None:
        self.items: list[str] = list(initial)
        self.quarantined: list[str] = []

    def add(self, note: str) -> None:
        self.items.append(note)

    def extend(self, notes: Iterable[str]) -> None:
        self.items.extend(notes)

    def add_new(self, notes: Iterable[str], *, warn: bool = False) -> None:
        """Add each note not already there (logged at WARNING when ``warn``)."""
        for note in notes:
            if note not in self.items:
                self.items.append(note)
                if warn:
                    log.warning("strata restore: %s", note)

    def warn(self, note: str) -> None:
        """Add ``note`` and log it at WARNING."""
        log.warning("strata restore: %s", note)
        self.items.append(note)

    def quarantine(
        self,
        ram: RamTier | Tier,
        job_id: str,
        step: int,
        rank: int,
        tier: str,
        exc: ShardCorrupt,
    ) -> str:
        """A copy served by ``tier`` failed verification while loading: note it, remember the
        tier, and quarantine the copy that was loaded (``ram``: the RAM copy it was staged into,
        or the tier's own copy when it was loaded where it lies; a quarantine that fails is
        noted, never raised). Returns the load error for the log."""
        error = f"{tier}: {exc}"
        self.items.append(f"{error} (quarantined)")
        self.quarantined.append(tier)
        try:
            ram.quarantine(job_id, step, rank, str(exc))
        except TierError as qexc:
            self.items.append(f"{ram.name}: quarantine failed: {qexc}")
        return error


def tier_location(config: StrataConfig, tier: str) -> str:
    """Where ``tier`` ("ram", "pvc", "gcs", "peer") is, for messages ("?" when not configured)."""
    if tier == "ram":
        return config.ram.path
    if tier == "pvc" and config.pvc is not None:
        return config.pvc.path
    if tier == "gcs" and config.gcs is not None:
        return f"gs://{config.gcs.bucket}/{config.gcs.prefix}"
    if tier == "peer" and config.peers is not None:
        return f"{len(config.peers.members)} peers (through the sidecar)"
    return "?"


def searched(config: StrataConfig) -> str:
    """The tiers a restore searches, with their locations (``ram=/dev/shm/..., pvc=...``)."""
    return ", ".join(f"{t}={tier_location(config, t)}" for t in config.tiers_in_restore_order())
