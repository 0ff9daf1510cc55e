"""Who writes a step's global commit record in a shared tier, and how the other sidecars learn
of it, at a cost per sidecar independent of the world size.

Listing a step shows its W ranks (2 W objects); listing the job shows K such steps. If every
sidecar of a job of W ranks on N nodes listed to find out whether a step is complete, one step
would cost N x 2 W / 1000 list pages (16,384 ranks on 2,048 nodes: ~67,000 requests a step on
GCS; the same directory reads on a shared Lustre/Filestore metadata server). So:

- **One designated writer per step**: the sidecar serving rank :func:`commit_writer_rank`
  ``(step, world size)`` (a hash of the step, so the duty, which costs one listing of the step and
  W manifest reads, rotates across nodes from step to step). It lists that step alone until every
  rank is there, then writes ``commit.json`` (:func:`strata.tiers.records.commit_if_complete`).
- **Everyone else reads the record**: one GET of ``commit.json`` per round while waiting for a
  step it placed shards of; never a listing.
- **Takeover**: a sidecar that placed shards of a step and has not seen its record for
  ``takeover_seconds`` (the designated writer died or is partitioned) does the designated
  writer's work itself, at most once per ``takeover_seconds`` per step, so a straggling node
  costs each waiting sidecar one step listing per ``takeover_seconds``, not one per round.
  Two writers racing is harmless: the record is created only if absent and an identical one is
  accepted (:func:`strata.tiers.records.write_commit`).

:class:`CommitDuty` keeps the takeover clocks; :class:`Committer` binds it to one sidecar (the
job, its durable tiers, this pod's writer id) for the engine's parts that settle steps: the
round, maintenance and back-fill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping

from strata.config import TierName
from strata.errors import CommitError, TierError
from strata.format.commit import StepCommit
from strata.format.incarnation import Incarnation
from strata.sidecar.promotion.world import World
from strata.tiers.base import Tier
from strata.tiers.records import commit_if_complete, read_commit

log = logging.getLogger("strata.promotion")

DEFAULT_TAKEOVER_SECONDS = 120.0
"""Seconds a sidecar waits for a step's designated writer before committing it itself: several
rounds and maintenance intervals (30 s), so a live writer always gets there first."""


def commit_writer_rank(step: int, world_size: int) -> int:
    """The rank whose sidecar writes ``step``'s commit record (Knuth's multiplicative hash of
    the step, so that steps taken every n steps still rotate the duty across ranks)."""
    if world_size <= 0:
        raise ValueError(f"world size must be positive, got {world_size}")
    return ((step * 2654435761) & 0xFFFFFFFF) % world_size


class CommitDuty:
    """This engine's part in committing steps of the durable tiers (see the module docstring).

    ``clock``: seconds, monotonic (the engine's). ``takeover_seconds``: see the module
    docstring. Not thread-safe by itself: called under the engine's tier lock.
    """

    def __init__(
        self, clock: Callable[[], float], takeover_seconds: float = DEFAULT_TAKEOVER_SECONDS
    ) -> None:
        self.clock = clock
        self.takeover_seconds = takeover_seconds
        self._since: dict[tuple[str, int], float] = {}

    def designated(self, step: int, world_size: int | None, ranks: Collection[int]) -> bool:
        """Whether this sidecar (serving ``ranks``) is ``step``'s commit writer; with the world
        size unknown every sidecar is."""
        return world_size is None or commit_writer_rank(step, world_size) in ranks

    def settle(
        self,
        tier: Tier,
        job_id: str,
        step: int,
        *,
        writer_id: str,
        ranks: Collection[int],
        world_size: int | None,
        incarnation: str | None,
        records: Iterable[Incarnation] = (),
    ) -> StepCommit | None:
        """The step's commit record in ``tier`` once it is there (read, or written by this call
        when this sidecar is the designated writer or takes over); None while it is not.

        A record of another incarnation than ``incarnation`` is not this step's commit (None).
        Raises :class:`CommitError` / :class:`TierError` as
        :func:`strata.tiers.records.commit_if_complete`.
        """
        key = (tier.name, step)
        now = self.clock()
        since = self._since.setdefault(key, now)
        try:
            found = read_commit(tier, job_id, step)
        except CommitError as exc:
            log.warning("commit record of step %d in %s is bad: %s", step, tier.name, exc)
            found = None  # the writer below replaces it once the shards verify
        if found is not None:
            self._since.pop(key, None)
            if incarnation is not None and found.incarnation != incarnation:
                return None
            return found
        if not self.designated(step, world_size, ranks):
            if now - since < self.takeover_seconds:
                return None
            log.info(
                "taking over the commit of step %d in %s: no record after %.0f s",
                step,
                tier.name,
                now - since,
                extra={"event": "commit_takeover", "tier": tier.name, "step": step},
            )
            self._since[key] = now  # next attempt at most one takeover interval later
        commit = commit_if_complete(tier, job_id, step, writer_id, incarnation, records)
        if commit is not None:
            self._since.pop(key, None)
        return commit

    def forget_older_than(self, step: int) -> None:
        for key in [k for k in self._since if k[1] < step]:
            del self._since[key]


class Committer:
    """Settles steps' commit records in the durable tiers ``durable`` of job ``job_id`` for
    the sidecar whose pod writer id is ``writer_id``, through ``duty`` (its takeover clocks).
    Called under the tier's lock, like :class:`CommitDuty`.
    """

    def __init__(
        self, duty: CommitDuty, job_id: str, durable: Mapping[TierName, Tier], writer_id: str
    ) -> None:
        self.duty = duty
        self.job_id = job_id
        self.durable = durable
        self.writer_id = writer_id

    def designated(self, step: int, world: World, ranks: Collection[int] | None = None) -> bool:
        """Whether this sidecar, serving ``ranks`` (default: the local ranks of ``world``), is
        ``step``'s commit writer at ``world``'s world size (every sidecar is while it is unknown)."""
        return self.duty.designated(step, world.world_size, world.ranks if ranks is None else ranks)

    def settle(
        self,
        name: TierName,
        step: int,
        world: World,
        *,
        ranks: Collection[int] | None = None,
        incarnation: str | None = None,
        records: Iterable[Incarnation] | None = None,
    ) -> StepCommit | None:
        """:meth:`CommitDuty.settle` of ``step`` in tier ``name`` at ``world``'s world size, for
        ``ranks`` (default: the local ranks of ``world``) and the step's own ``incarnation`` with
        its ``records`` (default: ``world``'s current incarnation and :meth:`World.chain`).

        None while the record is not there; a tier or commit error is logged, never raised
        (the step is settled again in a later round)."""
        try:
            return self.duty.settle(
                self.durable[name],
                self.job_id,
                step,
                writer_id=self.writer_id,
                ranks=world.ranks if ranks is None else ranks,
                world_size=world.world_size,
                incarnation=world.incarnation if incarnation is None else incarnation,
                records=world.chain() if records is None else records,
            )
        except (TierError, CommitError) as exc:
            log.warning("commit record of step %d in %s not written: %s", step, name, exc)
            return None
