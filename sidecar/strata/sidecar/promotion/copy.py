"""Copying one shard to a durable tier: from the nearest source that holds it, verified (by the
tier's own checked write where it does one, :attr:`Tier.put_checks_written`, else by reading the
committed copy back), retried with exponential backoff (at most ``max_attempts`` per (tier, step,
rank); a shard refused for want of space is tried again after the longest backoff, for as long as
the step is wanted, so it lands once space is back).

A source whose bytes do not match its manifest is quarantined (RAM or PVC) and never retried in
a loop (C-04); a committed copy that fails verification is quarantined in the destination.
Sources are other tiers that can be read as local files (:meth:`Tier.data_path`) and already
hold that exact shard (GCS is filled from the PVC when it holds it), else the RAM slot under a
:class:`~strata.tiers.slots.SlotLease` (C-05: the trainer may be writing the next step meanwhile;
the lease keeps this step's slot from being reused).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from strata.config import TierName
from strata.errors import ShardCorrupt, ShardUnavailable, TierError, TierFull
from strata.format.incremental import incremental_manifest, plan_refs, worth_it
from strata.format.incremental import same_logical_shard as _same
from strata.format.manifest import Manifest
from strata.format.projection import project
from strata.sidecar.promotion.events import EventKind, PromotionEvent
from strata.tiers.base import Tier
from strata.tiers.ram import RamTier
from strata.tiers.references import write_incremental, write_projected
from strata.tiers.slots import SlotLease

log = logging.getLogger("strata.promotion")


class ShardCopier:
    """Copies shards of ``job_id`` from RAM (or a nearer durable tier) into ``durable`` tiers.

    ``durable``: durable tiers, fastest first. ``lease_timeout``: seconds to wait for a slot's
    writer. ``backoff_seconds``: delay after the first failure, doubled after each further one.
    ``emit``: receives every :class:`PromotionEvent`. ``clock``: monotonic seconds.
    ``incremental``: store a shard whose chunks mostly equal the newest full shard of the same
    rank in the destination as an incremental copy (:mod:`strata.format.incremental`).
    ``components``: tier -> the top-level components an archive tier keeps (the copy there is
    archive-only, :mod:`strata.format.projection`).
    """

    def __init__(
        self,
        job_id: str,
        ram: RamTier,
        durable: Mapping[TierName, Tier],
        *,
        emit: Callable[[PromotionEvent], None],
        clock: Callable[[], float],
        lease_timeout: float,
        max_attempts: int,
        backoff_seconds: float,
        incremental: bool = True,
        incremental_tiers: Mapping[TierName, bool] | None = None,
        components: Mapping[TierName, Sequence[str]] | None = None,
    ) -> None:
        self.job_id = job_id
        self.ram = ram
        self.durable = durable
        self.emit = emit
        self.clock = clock
        self.lease_timeout = lease_timeout
        self.max_attempts = max_attempts
        self.backoff_seconds = backoff_seconds
        self.incremental = incremental
        self.incremental_tiers = dict(incremental_tiers or {})
        """Per tier: False turns incremental copies off there (``incremental`` is for all)."""
        self.components = {k: tuple(v) for k, v in (components or {}).items()}
        """Archive tiers: the top-level components each keeps."""
        self.bases: dict[tuple[TierName, int], int] = {}
        """(tier, rank) -> the newest full shard this copier committed there (the base that
        later incremental copies reference)."""
        self._looked: set[tuple[TierName, int]] = set()
        self.attempts: dict[tuple[TierName, int, int], tuple[int, float]] = {}
        """(tier, step, rank) -> (failed attempts, not before this clock time)."""
        self.full: dict[TierName, int] = {}
        """Tier -> the step whose copy last failed with no space left (until it succeeds)."""
        self.no_space: set[tuple[TierName, int, int]] = set()
        """Shards whose last failure was no space left (:class:`TierFull`): given up for a
        while, never for good: tried again once their backoff ends (space may be back)."""

    def forget_older_than(self, step: int) -> None:
        for key in [k for k in self.attempts if k[1] < step]:
            self.attempts.pop(key, None)
            self.no_space.discard(key)

    def given_up(self, name: TierName) -> set[int]:
        """Steps with a shard that failed ``max_attempts`` times on tier ``name`` (not retried;
        the engine promotes the next eligible step instead). A shard refused for want of space
        only stays given up until its backoff ends, then it is tried again."""
        now = self.clock()
        return {
            s
            for (t, s, r), (n, not_before) in self.attempts.items()
            if t == name and n >= self.max_attempts and not self._retry_full((t, s, r), now)
        }

    def _retry_full(self, key: tuple[TierName, int, int], now: float) -> bool:
        return key in self.no_space and now >= self.attempts.get(key, (0, 0.0))[1]

    def reset(self, name: TierName, step: int, rank: int) -> None:
        """Forget the failures of one shard (the SIGTERM flush ignores backoff)."""
        self.attempts.pop((name, step, rank), None)
        self.no_space.discard((name, step, rank))

    def promote_shard(
        self, name: TierName, step: int, rank: int, manifest: Manifest
    ) -> tuple[bool, int, str]:
        """(committed, bytes written, failure message) for one shard; never raises."""
        key = (name, step, rank)
        attempts, not_before = self.attempts.get(key, (0, 0.0))
        if attempts >= self.max_attempts and not self._retry_full(key, self.clock()):
            return (
                False,
                0,
                f"rank {rank} of step {step} to {name}: gave up after {attempts} attempts",
            )
        if self.clock() < not_before:
            return False, 0, f"rank {rank} of step {step} to {name}: backing off"
        dest = self.durable[name]
        try:
            if self.holds(dest, step, rank, manifest):
                return True, 0, ""
            nbytes = self._copy(name, dest, step, rank, manifest)
            if nbytes == 0 or not dest.put_checks_written:
                self._verify_copy(dest, step, rank)
        except Exception as exc:  # one bad shard never stops the engine
            if isinstance(exc, TierFull):
                self.full[name] = step
                self.no_space.add(key)
            else:
                self.no_space.discard(key)
            attempts += 1
            self.attempts[key] = (
                attempts,
                # no space: retried after at most the longest backoff, while it stays full
                self.clock() + self.backoff_seconds * 2 ** (min(attempts, self.max_attempts) - 1),
            )
            kind: EventKind = "gave_up" if attempts >= self.max_attempts else "failed"
            msg = f"promoting rank {rank} of step {step} to {name} failed ({attempts}/{self.max_attempts}): {exc}"
            log.warning(msg, extra={"event": kind, "tier": name, "step": step, "rank": rank})
            self.emit(PromotionEvent(kind, name, step, (rank,), message=str(exc)))
            return False, 0, msg
        self.attempts.pop(key, None)
        self.no_space.discard(key)
        return True, nbytes, ""

    def holds(self, tier: Tier, step: int, rank: int, manifest: Manifest) -> bool:
        """The tier already holds this exact shard committed (same logical CRC32C and length,
        as a full or an incremental copy)."""
        try:
            current = tier.get_manifest(self.job_id, step, rank)
        except ShardCorrupt as exc:
            self.quarantine(tier, step, rank, str(exc))
            return False
        except ShardUnavailable:
            return False
        if current.components is not None:  # an archive-only copy of this very save
            return current.created == manifest.created and current.writer_id == manifest.writer_id
        return _same(current, manifest)

    def _base(self, name: TierName, dest: Tier, rank: int, step: int) -> int | None:
        """The base for ``rank`` in ``dest``: the one this copier committed, else (once per
        tier and rank, e.g. after the sidecar restarted) the newest full shard found there."""
        key = (name, rank)
        if key not in self.bases and key not in self._looked:
            self._looked.add(key)
            try:
                steps = sorted(
                    (s for s in dest.step_numbers(self.job_id) if s < step), reverse=True
                )
                for s in steps[:4]:
                    m = dest.get_manifest(self.job_id, s, rank)
                    if m.refs is None and m.verified:
                        self.bases[key] = s
                        break
            except TierError as exc:
                log.info("no base found for rank %d in %s: %s", rank, name, exc)
        return self.bases.get(key)

    def _holds_full(self, tier: Tier, step: int, rank: int, manifest: Manifest) -> bool:
        """The tier holds this shard as a full copy (its data file can be a copy source)."""
        try:
            current = tier.get_manifest(self.job_id, step, rank)
        except ShardUnavailable:
            return self.holds(tier, step, rank, manifest)  # quarantines a corrupt one
        return current.refs is None and current.components is None and _same(current, manifest)

    def _put(
        self, name: TierName, dest: Tier, step: int, rank: int, path: Path, m: Manifest
    ) -> int:
        """Commit the full shard at ``path`` into ``dest``: incrementally when a base there
        shares enough of it, else in full (it then becomes the base). An archive tier gets the
        components it keeps (and that copy may be incremental against its own base)."""
        keep = self.components.get(name)
        if keep:
            projected, pieces = project(m, keep)
            with tempfile.TemporaryDirectory(prefix="strata-archive-") as tmp:
                data = Path(tmp) / "data"
                sealed = write_projected(path, m, projected, pieces, data)
                return self._put_full_or_incremental(name, dest, step, rank, data, sealed)
        return self._put_full_or_incremental(name, dest, step, rank, path, m)

    def _put_full_or_incremental(
        self, name: TierName, dest: Tier, step: int, rank: int, path: Path, m: Manifest
    ) -> int:
        on = self.incremental and self.incremental_tiers.get(name, True)
        base = self._base(name, dest, rank, step) if on else None
        if base is not None and base < step:
            try:
                base_m = dest.get_manifest(self.job_id, base, rank)
            except TierError:
                base_m = None
            chunks = plan_refs(m, base_m) if base_m is not None else []
            if worth_it(m, chunks):
                stored = incremental_manifest(m, base, chunks)
                with tempfile.TemporaryDirectory(prefix="strata-inc-") as tmp:
                    data = Path(tmp) / "data"
                    write_incremental(path, stored, data)
                    return dest.put_shard(self.job_id, step, rank, data, stored)
        n = dest.put_shard(self.job_id, step, rank, path, m)
        if m.refs is None and (base is None or base < step):
            self.bases[(name, rank)] = step
        return n

    def _copy(self, name: TierName, dest: Tier, step: int, rank: int, manifest: Manifest) -> int:
        for source_name, source in self.durable.items():
            if source_name == name:
                break  # only faster tiers than the destination
            path = source.data_path(self.job_id, step, rank)
            if path is None or not self._holds_full(source, step, rank, manifest):
                continue
            try:
                return self._put(name, dest, step, rank, path, manifest)
            except ShardCorrupt as exc:
                # That copy does not match its manifest: quarantine it, fall back to RAM now.
                self.quarantine(source, step, rank, str(exc))
        with SlotLease(self.ram, self.job_id, step, rank, timeout=self.lease_timeout) as lease:
            current = lease.manifest
            if current is None or current.crc32c != manifest.crc32c:
                raise ShardUnavailable(
                    f"RAM shard rank {rank} of step {step} changed while being promoted"
                )
            try:
                return self._put(name, dest, step, rank, lease.path, current)
            except ShardCorrupt as exc:
                self.quarantine(self.ram, step, rank, str(exc))
                raise

    def _verify_copy(self, dest: Tier, step: int, rank: int) -> None:
        """Check the committed copy; quarantine it and raise ShardCorrupt when it is bad."""
        try:
            dest.verify_shard(self.job_id, step, rank)
        except ShardCorrupt as exc:
            self.quarantine(dest, step, rank, f"verification after copy: {exc}")
            raise

    def quarantine(self, tier: Tier, step: int, rank: int, reason: str) -> None:
        self.emit(PromotionEvent("checksum_mismatch", tier.name, step, (rank,), message=reason))
        try:
            tier.quarantine(self.job_id, step, rank, reason)
        except TierError as exc:
            log.error("cannot quarantine rank %d of step %d in %s: %s", rank, step, tier.name, exc)
