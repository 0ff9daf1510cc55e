"""The restore of one rank: :class:`Restorer` (what :meth:`strata.Checkpointer.restore` runs).

Inventory of every tier -> the ``inventory`` phase -> the newest step restorable on every rank
(:func:`strata.restore.plan_restore`) -> stage this rank's shard into RAM (RAM hit, else peer,
PVC, GCS; verified) -> ``stage`` -> load it in place -> ``load`` -> open the incarnation ->
sharded tensors (``replicas``, ``sharded``). Before the first round (unless resharding is off)
every rank's reshard sources are gathered (``reshard-candidate``); when the step they pick is
newer than the plan's, it is resharded instead (``reshard-check``: refused on every rank alike
when it holds per-rank values without an accepted rule; then ``reshard``;
:mod:`strata.restore.reshard`). A step some rank fails to stage is excluded and the ranks plan
again; a copy that fails verification while loading is quarantined and the ranks plan again.
The phases are :mod:`strata.client.collectives` (every rank calls them in the same order);
this rank's own work is :mod:`strata.client.restore_load`; notes and quarantined copies are
:mod:`strata.client.restore_notes`.

The restorer takes only its collaborators: the configuration (tier order, fresh starts,
verification, locations), the RAM tier, a :class:`strata.client.stager.Stager`, the phases, the
loader, a ``report`` callback (restore events) and an ``on_incarnation`` callback (the save path
stamps the id into its manifests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from strata.client import steps as _steps
from strata.client.collectives import RestoreCollectives
from strata.client.restore_load import DirectShard, RankLoader, RestoreTiers
from strata.client.restore_notes import RestoreNotes, searched
from strata.client.stager import Stager
from strata.config import StrataConfig
from strata.errors import RestoreError, ShardCorrupt, StageError
from strata.format.incarnation import Incarnation, Lineage, new_incarnation_id
from strata.protocol import ClientEvent, RestoreEvent, StageRequest
from strata.restore import RestorePlan, StageResult, plan_restore, skipped_partial_steps
from strata.restore.reshard import (
    LOCAL_SOURCES,
    PerRankValues,
    ReshardChoice,
    ReshardPolicy,
    pick_reshard,
    refusal,
    reshard_sources,
)
from strata.tiers.base import Tier
from strata.tiers.ram import RamTier
from strata.tiers.records import write_incarnation

log = logging.getLogger("strata.client")

MAX_ROUNDS = 64
"""Planning rounds of one restore (each excludes a step or quarantines a copy)."""


@dataclass
class RestoreResult:
    """What :meth:`Checkpointer.restore` did."""

    step: int | None
    """The restored step; None: fresh start (nothing restorable and fresh starts allowed)."""
    tiers: dict[int, str]
    """Per rank, the tier that served its shard (all ranks with torch.distributed)."""
    nbytes: int
    """Bytes of this rank's shard."""
    seconds: float
    """Wall time of the whole restore on this rank (inventory, staging, load)."""
    skipped: list[str] = field(default_factory=list)
    """Notes: partial steps (C-03), quarantined copies (C-04), other world sizes, tiers down."""
    state: Any = None
    """The loaded state tree (live objects where they were updated in place)."""
    component_steps: dict[str, int] = field(default_factory=dict)
    """Components saved at their own cadence: the step each one's bytes come from
    (``component_every``); empty: every component is from ``step``."""
    resharded: bool = False
    """The step was written at another world size and resharded to this one
    (:mod:`strata.restore.reshard`); ``tiers`` then names ``"reshard"`` for this rank and the
    notes name the tiers read."""
    saved_world_size: int | None = None
    """The world size that wrote ``step`` (None: fresh start)."""
    per_rank_source: int | None = None
    """Resharded: the saved rank whose per-rank values (plain tensors, RNG, dataloader state)
    this rank took by :data:`strata.restore.reshard.PER_RANK_RULE` (None: not resharded)."""

    @property
    def fresh_start(self) -> bool:
        return self.step is None

    @property
    def next_step(self) -> int:
        """The step to train next: restored step + 1, or 0 on a fresh start."""
        return 0 if self.step is None else self.step + 1

    @property
    def tier(self) -> str | None:
        """This rank's tier (the first entry when called on a single process)."""
        return next(iter(self.tiers.values()), None)


SlotsAfter = tuple[int, bool] | Literal["from-state", "none"]
"""What the next save's slots need after a restore: (data bytes, CUDA) from the shard loaded,
``"from-state"`` (size them by encoding the live state) or ``"none"`` (leave them)."""


@dataclass
class Restored:
    """A :meth:`Restorer.restore` that returned: its result and what the slots need."""

    result: RestoreResult
    slots: SlotsAfter


class Restorer:
    """The restore of rank ``rank`` of ``world_size`` (see the module docstring).

    ``reshard``: when a step written at another world size is restored (by resharding) from
    any tier that holds every shard of it (:mod:`strata.restore.reshard`). Raises nothing at
    construction.
    """

    def __init__(
        self,
        config: StrataConfig,
        ram: RamTier,
        stager: Stager,
        tiers: RestoreTiers,
        phases: RestoreCollectives,
        loader: RankLoader,
        *,
        rank: int,
        world_size: int,
        reshard: ReshardPolicy,
        report: Callable[[ClientEvent], None],
        on_incarnation: Callable[[str], None],
    ) -> None:
        self.config = config
        self.job_id = config.job_id
        self.ram = ram
        self.stager = stager
        self.tiers = tiers
        self.phases = phases
        self.loader = loader
        self.rank = rank
        self.world_size = world_size
        self.reshard = reshard
        self.report = report
        self.on_incarnation = on_incarnation

    def restore(self, state: Any, step: int | None, started: float) -> Restored:
        """Restore the newest restorable step (or exactly ``step``) into ``state``; ``started``:
        ``time.perf_counter()`` when the caller's restore began. Raises as
        :meth:`strata.Checkpointer.restore` documents."""
        self.phases.begin()
        now = datetime.now(UTC)
        proposal = {"id": new_incarnation_id(now), "created": now.isoformat()}
        chosen: dict[str, str] | None = None
        excluded: list[int] = []
        clobbered = False
        no_direct: set[tuple[str, int]] = set()  # (tier, step) that failed to load in place
        self.tiers.get()
        notes = RestoreNotes(self.tiers.notes)
        if self.world_size > 1 and not self.phases.distributed:
            notes.add(
                f"world size {self.world_size} without torch.distributed: other ranks' RAM tiers "
                "cannot be seen, so only the PVC and GCS can serve a complete step; call "
                "torch.distributed.init_process_group() before restore()"
            )
        cand = self._reshard_choice(step, notes)
        # the reshard sources were listed: what the peers' listing said (unreachable peers)
        notes.add_new(self.tiers.listing_notes())
        for _ in range(MAX_ROUNDS):
            inv = self.stager.inventory(self.job_id, self.rank, self.world_size)
            invs, proposed = self.phases.exchange_inventories(inv, proposal)
            invs = _steps.pin_step(invs, step)
            chosen = chosen or proposed  # the first round's: one incarnation for the world
            notes.add_new(
                skipped_partial_steps(invs) + [n for i in invs for n in i.notes], warn=True
            )
            plan = plan_restore(
                invs, self.world_size, self.config.tiers_in_restore_order(), excluded
            )
            # Every branch below depends only on gathered values: every rank takes it alike.
            if cand is not None and (plan is None or cand.step > plan.step):
                resharded = self._reshard(state, cand, notes, started, chosen)
                if resharded is not None:
                    return Restored(resharded, "none")
                cand = None
                continue
            if plan is None:
                break
            direct = self._direct(plan, no_direct)
            res: StageResult | None
            if direct is not None:
                m = direct.manifest
                res, err = StageResult(direct.tier.name, direct.path, m, m.data_nbytes, 0.0), None
            else:
                res, err = self._stage(plan, notes)
            outcomes = self.phases.agree_staged(None if res is None else res.tier)
            if res is None or any(o is None for o in outcomes):
                log.warning(
                    "strata restore: step %d could not be staged on every rank (%s); re-planning "
                    "without it",
                    plan.step,
                    err or "another rank failed",
                )
                excluded.append(plan.step)
                continue
            notes.add_new(res.skipped)
            failure: BaseException | None = None
            loaded, load_err = None, None
            try:
                if direct is not None:
                    loaded = self.loader.load_direct(state, direct)
                else:
                    loaded = self.loader.load_staged(state, plan.step, res.tier, notes.items)
            except ShardCorrupt as exc:
                clobbered, failure = True, exc
                holder = self.ram if direct is None else direct.tier
                load_err = notes.quarantine(
                    holder, self.job_id, plan.step, self.rank, res.tier, exc
                )
            except OSError as exc:
                if direct is None:
                    load_err, failure = f"{res.tier}: {exc!r}", exc
                else:  # nothing was written: every rank plans again, this one stages it
                    notes.add(f"{res.tier}: could not be loaded where it lies ({exc}); staged")
                    no_direct.add((res.tier, plan.step))
                    load_err, failure = f"{res.tier}: {exc!r}", ShardCorrupt(str(exc))
            except Exception as exc:  # any other failure: every rank learns of it (no hang)
                load_err, failure = f"{res.tier}: {exc!r}", exc
            if not self.phases.settle_load(plan.step, failure):
                # A copy failed verification while loading (here or on another rank): every
                # rank plans again; the quarantined copy is no longer listed.
                log.warning(
                    "strata restore: step %d failed to load (%s); re-planning",
                    plan.step,
                    load_err or "on another rank",
                )
                continue
            assert loaded is not None
            self._open_incarnation(chosen, plan.incarnation or None, plan.step, notes, plan.lineage)
            err_sharded: BaseException | None = None
            try:
                self.phases.exchange_replicas(loaded.sharded)
                self.loader.fill_pending(loaded.sharded, plan.step, notes.items)
            except Exception as exc:  # any failure (a device copy, NCCL): every rank learns of it
                err_sharded = exc
            self.phases.settle_sharded(plan.step, err_sharded)
            result = RestoreResult(
                step=plan.step,
                tiers={r: t for r, t in enumerate(outcomes) if t is not None}
                if len(outcomes) > 1
                else {self.rank: res.tier},
                nbytes=res.nbytes,
                seconds=time.perf_counter() - started,
                skipped=notes.items,
                state=loaded.tree,
                component_steps=dict(loaded.component_steps),
                saved_world_size=self.world_size,
            )
            if loaded.component_steps:
                log.warning(
                    "strata: step %d holds components from earlier steps (own cadence): %s",
                    plan.step,
                    loaded.component_steps,
                )
            log.warning(
                "strata: restored step %d of job %s rank %d from the %s tier (%d bytes, %.3f s)",
                plan.step,
                self.job_id,
                self.rank,
                res.tier,
                res.nbytes,
                result.seconds,
            )
            self._report_restore(result, "restored", notes)
            hint = loaded.slots_hint
            return Restored(result, hint if hint is not None and hint[0] > 0 else "from-state")
        return self._nothing_restorable(
            step, notes, started, chosen or proposal, excluded, clobbered, state
        )

    def _direct(self, plan: RestorePlan, no_direct: set[tuple[str, int]]) -> DirectShard | None:
        """This rank's copy of ``plan``'s step to load where it lies, when the nearest tier
        that holds it for this rank is a durable file system this process mounts (the PVC):
        one read straight into the state instead of a copy into RAM and a second copy out
        (:meth:`RankLoader.direct_source`). None: stage it (a RAM hit, GCS, the peers, an
        incremental copy, or a copy that failed to load in place this restore)."""
        sources = plan.sources.get(self.rank, ())
        if not self.config.restore.load_in_place or not sources:
            return None
        if (sources[0], plan.step) in no_direct:
            return None
        tier = next((t for t in self.tiers.get() if t.name == sources[0]), None)
        found = None if tier is None else self.loader.direct_source(tier, plan.step)
        if (
            found is not None
            and plan.incarnation
            and found.manifest.incarnation != plan.incarnation
        ):
            return None  # replaced since it was listed: the stager's checks say why
        return found

    def _stage(
        self, plan: RestorePlan, notes: RestoreNotes
    ) -> tuple[StageResult | None, str | None]:
        """Stage this rank's shard of ``plan``; (result, None) or (None, why not). Never raises:
        a failure fails this step only, in lockstep with the other ranks."""
        try:
            res = self.stager.stage(
                StageRequest(
                    job_id=self.job_id,
                    step=plan.step,
                    rank=self.rank,
                    world_size=self.world_size,
                    sources=plan.sources[self.rank],
                )
            )
        except StageError as exc:
            notes.extend(exc.skipped)
            return None, str(exc)
        except Exception as exc:  # stay in lockstep with the other ranks: fail this step only
            err = f"staging failed: {exc!r}"
            notes.add(f"step {plan.step}: {err}")
            return None, err
        return res, None

    def _nothing_restorable(
        self,
        step: int | None,
        notes: RestoreNotes,
        started: float,
        chosen: dict[str, str],
        excluded: list[int],
        clobbered: bool,
        state: Any,
    ) -> Restored:
        """No step could be restored on every rank: a fresh start where allowed, else raise."""
        where = searched(self.config)
        allow_fresh = self.config.restore.allow_fresh_start
        if step is not None or not allow_fresh or clobbered:
            failed = RestoreResult(None, {}, 0, time.perf_counter() - started, notes.items)
            self._report_restore(failed, "failed", notes)
        if step is not None:
            raise _steps.not_restorable(self.job_id, step, self.world_size, where, notes.items)
        if allow_fresh and clobbered:
            raise RestoreError(
                f"no verifying copy of job {self.job_id!r} is left, and a corrupt copy was "
                "partly loaded into the live state before its checksum failed, so a fresh start "
                "would train from mixed weights: re-create the model and optimizer and call "
                f"restore() again (notes: {'; '.join(notes.items)})"
            )
        if allow_fresh:
            log.warning(
                "strata: NO restorable checkpoint for job %s (searched %s); starting from scratch "
                "because restore.allow_fresh_start is set",
                self.job_id,
                where,
            )
            self._open_incarnation(chosen, None, None, notes)
            fresh = RestoreResult(None, {}, 0, time.perf_counter() - started, notes.items, state)
            self._report_restore(fresh, "fresh-start", notes)
            return Restored(fresh, "from-state")
        raise RestoreError(
            f"no restorable checkpoint for job {self.job_id!r} with world size {self.world_size} "
            f"(searched {where}; excluded after failed staging: {excluded or 'none'}; notes: "
            f"{'; '.join(notes.items) or 'none'}). Set restore.allowFreshStart in the "
            "CheckpointPolicy (or allow_fresh_start=True) to start from scratch"
        )

    def _reshard_choice(self, step: int | None, notes: RestoreNotes) -> ReshardChoice | None:
        """The ``reshard-candidate`` phase (unless resharding is off): every rank's reshard
        sources, and the step every rank would reshard (:func:`pick_reshard`; ``step``: only
        that one). Never raises: a rank that cannot list its tiers offers no source."""
        if not self.reshard.enabled:
            return None
        try:
            # one rank lists the shared tiers for all (their sources serve every rank)
            shared = self.rank == 0 or not self.phases.distributed
            mine = reshard_sources(
                self.tiers.get(), self.job_id, self.rank, self.world_size, shared
            )
        except Exception as exc:  # stay in lockstep: this rank offers no source
            notes.warn(f"reshard sources not listed: {exc!r}")
            mine = {"rank": self.rank, "sources": [], "records": []}
        gathered = self.phases.exchange_reshard_sources(mine)
        return pick_reshard(gathered, self.world_size, self.config.tiers_in_restore_order(), step)

    def _reshard(
        self,
        state: Any,
        choice: ReshardChoice,
        notes: RestoreNotes,
        started: float,
        chosen: dict[str, str],
    ) -> RestoreResult | None:
        """Restore ``choice.step``, written by ``choice.saved_world_size`` ranks, at this world
        size from this rank's sources (the ``reshard-check`` and ``reshard`` phases;
        :meth:`RankLoader.check_resharded`, :meth:`RankLoader.read_resharded`). None (noted)
        when some rank could not read or load it. Raises :class:`ReshardRefused` (every rank,
        before the live state is touched) when the step holds per-rank values and the policy
        does not accept :data:`PER_RANK_RULE` for them."""
        step, saved_world = choice.step, choice.saved_world_size
        names = choice.sources.get(self.rank, ())
        tiers = [t for t in self.tiers.get() if t.name in names]
        check = self.loader.check_resharded(step, saved_world, tiers, choice.incarnation)
        blocking, errors = self.phases.settle_reshard_check(check.values.blocking, check.error)
        if errors:
            check.close(notes.items)
            notes.warn(
                f"step {step} (world size {saved_world}) could not be resharded: {errors[0]}"
            )
            return None
        if blocking and not self.reshard.per_rank:
            check.close(notes.items)
            values = check.values if check.values.blocking else PerRankValues(differing=blocking)
            refused = refusal(step, saved_world, self.world_size, values)
            notes.warn(str(refused))
            failed = RestoreResult(None, {}, 0, time.perf_counter() - started, notes.items)
            self._report_restore(failed, "failed", notes)
            raise refused
        read = self.loader.read_resharded(state, check, notes.items)
        errors = self.phases.settle_reshard(read.error)
        if errors:
            notes.warn(
                f"step {step} (world size {saved_world}) could not be resharded: {errors[0]}"
            )
            return None
        if blocking:
            which = ", ".join(blocking[:8]) + (
                f" and {len(blocking) - 8} more" if len(blocking) > 8 else ""
            )
            if read.source_rank != self.rank:
                notes.add(
                    f"rank {self.rank} did not exist in step {step} (world size {saved_world}): "
                    f"its per-rank values ({which}) are rank {read.source_rank}'s"
                )
            if saved_world > self.world_size:
                notes.add(
                    f"the per-rank values ({which}) of saved ranks {self.world_size}-"
                    f"{saved_world - 1} of step {step} are not restored: no rank of this world "
                    "size takes them"
                )
        notes.add(
            f"step {step} resharded from world size {saved_world} to {self.world_size} (read "
            f"from {', '.join(read.tiers) or 'no tier'})"
        )
        self._open_incarnation(chosen, read.parent or None, step, notes, choice.lineage)
        result = RestoreResult(
            step=step,
            tiers={self.rank: "reshard"},
            nbytes=read.nbytes,
            seconds=time.perf_counter() - started,
            skipped=notes.items,
            state=read.tree,
            resharded=True,
            saved_world_size=saved_world,
            per_rank_source=read.source_rank,
        )
        log.warning(
            "strata: restored step %d of job %s rank %d by resharding from world size %d "
            "(from %s; %d bytes read for %d needed, %.3f s)",
            step,
            self.job_id,
            self.rank,
            saved_world,
            ", ".join(read.tiers),
            read.nbytes,
            read.nbytes_needed,
            result.seconds,
        )
        self._report_restore(result, "restored", notes)
        return result

    def _open_incarnation(
        self,
        chosen: dict[str, str],
        parent: str | None,
        base_step: int | None,
        notes: RestoreNotes,
        lineage: Lineage | None = None,
    ) -> None:
        """Open the incarnation agreed in the ``inventory`` phase: from now on every manifest
        carries its id. Its record (identical bytes on every rank: ``lineage`` is built from the
        gathered records) goes into this node's RAM tier (every rank; the sidecar copies it next
        to the steps it commits), and rank 0 also writes it to the shared tiers now, so the
        lineage survives the loss of every node. The record carries the chain it continues
        (``ancestors``, from ``lineage``: the one the step was chosen by)."""
        rec = Incarnation(
            job_id=self.job_id,
            id=chosen["id"],
            parent=parent,
            base_step=base_step,
            world_size=self.world_size,
            created=datetime.fromisoformat(chosen["created"]),
            ancestors=(Lineage(()) if lineage is None else lineage).ancestry(parent, base_step),
        )
        targets: list[Tier] = [self.ram]
        if self.rank == 0:
            targets += [t for t in self.tiers.get() if t.name not in LOCAL_SOURCES]
        for tier in targets:
            try:
                write_incarnation(tier, rec)
            except Exception as exc:  # the lineage is also carried by the sidecars' commits
                notes.warn(f"{tier.name}: incarnation record {rec.id} not written: {exc}")
        self.on_incarnation(rec.id)
        log.info(
            "strata: job %s rank %d opened incarnation %s (parent %s, resumed from step %s)",
            self.job_id,
            self.rank,
            rec.id,
            parent,
            base_step,
        )

    def _report_restore(
        self,
        result: RestoreResult,
        outcome: Literal["restored", "fresh-start", "failed"],
        notes: RestoreNotes,
    ) -> None:
        self.report(
            RestoreEvent(
                job_id=self.job_id,
                rank=self.rank,
                outcome=outcome,
                step=result.step,
                tier=result.tiers.get(self.rank, result.tier),
                nbytes=result.nbytes,
                seconds=result.seconds,
                skipped=result.skipped[:16],
                quarantined=list(notes.quarantined),
            )
        )
