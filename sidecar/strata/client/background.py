"""The save path's background work: :class:`BackgroundWork` (one thread, in order) and the
checksum pass it runs after each commit (:class:`ChecksumPass`).

One thread runs, in submission order, every checksum pass, every confirmation of storages left
in place (:mod:`strata.client.reuse`), slot preparation, and the client's reports to the
sidecar, so that a report never overtakes the checksum of its step. :meth:`BackgroundWork.wait`
waits for what was submitted so far.

A checksum pass (:meth:`ChecksumPass.run`): under a slot lease, checksum a committed step's
slot and atomically rewrite its manifest with the CRC32Cs (:meth:`strata.tiers.ram.RamTier.seal`)
and the per-storage "unchanged since" hint (:mod:`strata.client.unchanged`); promotion only
takes checksummed shards. A step that left RAM meanwhile, or that someone else checksummed, is
skipped; any other failure is recorded (``last_error``), never raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from strata.client.outcomes import SaveOutcomes
from strata.client.reuse import SlotReuse
from strata.client.unchanged import Snapshot, UnchangedTracker, storage_signatures
from strata.errors import ShardUnavailable
from strata.format.manifest import StorageEntry
from strata.tiers.ram import RamTier
from strata.tiers.slots import Identity, SlotLease

log = logging.getLogger("strata.client")


class BackgroundWork:
    """Work submitted to ``executor`` (one thread; the caller owns it) that :meth:`wait` waits
    for."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._pending: list[Future[Any]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in the background, tracked. Raises RuntimeError once the executor
        is shut down."""
        fut = self.executor.submit(fn, *args)
        self.track(fut)
        return fut

    def track(self, fut: Future[Any]) -> None:
        """Make :meth:`wait` wait for ``fut`` too (work submitted elsewhere)."""
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]

    def wait(self, timeout: float | None = None) -> None:
        """Wait for everything submitted so far (``timeout`` seconds each); raises what the
        work raised, TimeoutError."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result(timeout=timeout)


Checksum = tuple[int, str, Snapshot, Identity, list[StorageEntry]]
"""A committed step's checksum pass to start: (step, its manifest's ``created``, the live
tensors and their versions as copied, the slot's identity, the storages) --
:meth:`ChecksumPass.run`'s arguments."""


class ChecksumPass:
    """Checksum passes of rank ``rank`` of ``job_id`` in ``ram``; ``reuse`` learns what each
    checksummed slot holds; failures go to ``outcomes``."""

    def __init__(
        self,
        ram: RamTier,
        job_id: str,
        rank: int,
        reuse: SlotReuse,
        outcomes: SaveOutcomes,
    ) -> None:
        self.ram = ram
        self.job_id = job_id
        self.rank = rank
        self.reuse = reuse
        self.outcomes = outcomes
        self.unchanged = UnchangedTracker()
        """The "unchanged since" hint per storage (:meth:`forget` starts it afresh)."""

    def forget(self) -> None:
        """Start the hint afresh (after a restore wrote the live tensors)."""
        self.unchanged = UnchangedTracker()

    def start(self, work: BackgroundWork, checksum: Checksum) -> None:
        """Submit ``checksum``'s pass to ``work``; never raises (the step then stays committed
        without checksums, as when its writer dies)."""
        try:
            work.submit(self.run, *checksum)
        except RuntimeError as exc:  # the background executor was shut down
            self.outcomes.error(f"checksum of step {checksum[0]} not started: {exc}")

    def run(
        self,
        step: int,
        created: str,
        snap: Snapshot,
        slot: Identity,
        storages: list[StorageEntry],
    ) -> None:
        try:
            # The hint is tracked even when the shard is gone: the next save compares with it.
            sigs = storage_signatures(snap.live, snap.versions, snap.sources)
            unchanged = self.unchanged.since(step, snap, sigs)
            with SlotLease(self.ram, self.job_id, step, self.rank) as lease:
                m = lease.manifest
                if m is None or m.verified or m.created.isoformat() != created:
                    return
                if self.ram.seal(lease, unchanged) is not None:
                    self.reuse.remember(slot, step, storages, sigs, snap.sources)
        except ShardUnavailable as exc:
            log.info("strata: step %d left the RAM tier before its checksum pass: %s", step, exc)
        except Exception as exc:
            self.outcomes.error(f"checksum of step {step} failed: {exc}")
