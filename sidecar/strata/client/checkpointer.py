"""The training client: ``strata.Checkpointer`` (torch; never imports kopf).

::

    ckpt = strata.Checkpointer()                 # StrataConfig.from_env() + RANK/WORLD_SIZE
    state = {"model": model, "optim": optimizer, "step": 0, "rng": torch.get_rng_state()}
    result = ckpt.restore(state)                 # newest restorable step, loaded in place
    for step in range(result.next_step, steps):
        ...
        if ckpt.should_save(step):
            ckpt.save(step, state)               # blocks only for the copy into a RAM slot

``save(step, state)`` (:class:`strata.client.saver.Saver`): encodes the state
(:mod:`strata.format.codec`), takes a free slot of the RAM ring (:mod:`strata.tiers.slots`),
copies every tensor storage into it (several threads), commits the step in the RAM tier with a
manifest *without* checksums, and returns. The stall is the copy. A background thread then checksums the slot and atomically rewrites the manifest with its
CRC32Cs; promotion (the sidecar) only takes checksummed shards. :meth:`Checkpointer.wait`
waits for that background work. C-01: once ``save()`` returned, the step's bytes are in the
slot; changing the state afterwards does not change what is restored.

Failure policy (explicit): a save that fails for a reason of the *environment or the data* --
ENOSPC on the RAM tier, every slot busy, a value the codec cannot store (TypeError naming its
path), an I/O error -- is logged at ERROR, recorded (``last_error``, ``failed_saves``) and
``save()`` returns False; training continues and every previously committed step is intact.
Programming errors raise at once: a negative or non-int step (ValueError). Pass
``raise_on_error=True`` to raise every save failure instead.

``restore(state)``: inventory of every tier -> all-gather across ranks when torch.distributed is
initialized -> the newest step restorable on every rank (:func:`strata.restore.plan_restore`)
-> stage this rank's shard into RAM (RAM hit, else PVC, else GCS; verified; a corrupt copy is
quarantined) -> load it in place (:func:`strata.format.codec.load_into`). A step some rank fails to
stage is excluded and the ranks re-plan together. No restorable step: a fresh start (step None)
when ``restore.allow_fresh_start``, else :class:`RestoreError` naming the tiers searched.

Seams for the sidecar (socket-backed implementations): ``slot_provider=`` (a
:class:`strata.tiers.ram.SlotProvider`) and ``stager=`` (a :class:`Stager`). Without them, a
ready sidecar answering on ``config.socket`` serves both (:func:`strata.client.sidecar_client.connect`);
without a sidecar the client reaches every tier directly (RAM and PVC as directories, GCS via
:class:`strata.tiers.gcs.GcsTier`, imported only when ``config.gcs`` is set).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal

import torch

from strata.client import steps as _steps
from strata.client.cadence import ComponentCadence
from strata.client.cuda_host import holds_cuda
from strata.client.late_sidecar import SidecarWatch
from strata.client.lineage_guard import join_or_refuse
from strata.client.loader import load_failure, load_shard, settle_load
from strata.client.saver import Saver
from strata.client.sharded import ShardedLoad, ShardReader, reshard_candidate
from strata.client.stager import LocalStager, Stager
from strata.client.termination import Termination
from strata.config import StrataConfig
from strata.constants import ENV_RESTORE_RESHARD
from strata.errors import ConfigError, RestoreError, ShardCorrupt, StageError, TierError
from strata.format import codec
from strata.format.incarnation import Incarnation, new_incarnation_id
from strata.protocol import ClientEvent, RestoreEvent
from strata.restore import (
    RankInventory,
    StageResult,
    plan_restore,
    skipped_partial_steps,
)
from strata.tiers.base import Tier
from strata.tiers.configured import durable_tiers, in_restore_order
from strata.tiers.ram import RamTier
from strata.tiers.records import write_incarnation
from strata.tiers.slots import (
    LocalSlotProvider,
    ReuseFirstSlotProvider,
    SlotLease,
    SlotProvider,
)

log = logging.getLogger("strata.client")


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
    """Components saved at their own cadence: the step each one's bytes come from (issue 18;
    ``component_every``); empty: every component is from ``step``."""

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


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


class Checkpointer:
    """Multi-tier checkpointing for one training process (one rank). See the module docstring.

    Configuration: ``config`` or :meth:`StrataConfig.from_env`; keyword arguments override
    (``job_id``, ``ram_dir``, ``pvc_dir``, ``keep``, ``every_steps``, ``allow_fresh_start``).
    Identity: ``rank``/``world_size`` arguments, else torch.distributed when initialized, else
    env ``RANK``/``WORLD_SIZE``, else 0/1. ``copy_threads``: threads copying into the slot.
    ``process_group``: for the all-gather of inventories (default group).
    ``register_limit_bytes``: the most RAM-slot bytes page-locked with CUDA at once when the
    state holds CUDA tensors (None: only the driver's limits; :mod:`strata.client.cuda_host`).
    ``component_every``: top-level keys of a dict state saved at their own cadence (e.g.
    ``{"ema": 100}``; :mod:`strata.client.cadence`; default ``config.component_every``).
    ``reshard``: let :meth:`restore` load a step written at another world size when it is the
    newest step complete in a shared tier (sharded tensors resharded; docs/architecture.md
    "Sharded state"). Default False (also env ``STRATA_RESTORE_RESHARD=1``): such a step is
    skipped and noted, as before.
    Raises :class:`strata.config.ConfigError` for a bad configuration.

    One Checkpointer per training process; call ``save``/``restore`` from one thread (the
    training loop). ``close()`` (or ``with``) waits for background checksums and unmaps slots.
    """

    def __init__(
        self,
        config: StrataConfig | None = None,
        *,
        job_id: str | None = None,
        ram_dir: str | os.PathLike[str] | None = None,
        pvc_dir: str | os.PathLike[str] | None = None,
        keep: int | None = None,
        every_steps: int | None = None,
        allow_fresh_start: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        slot_provider: SlotProvider | None = None,
        stager: Stager | None = None,
        copy_threads: int = 4,
        raise_on_error: bool = False,
        component_every: Mapping[str, int] | None = None,
        process_group: Any = None,
        reshard: bool | None = None,
        register_limit_bytes: int | None = None,
    ) -> None:
        self.config = _build_config(
            config, job_id, ram_dir, pvc_dir, keep, every_steps, allow_fresh_start
        )
        self.job_id = self.config.job_id
        self.rank, self.world_size = _identity(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        self.writer_id = f"{self.config.pod_writer_id}/rank-{self.rank}"
        # Training waits for a restore: verify a RAM shard with every core (CRC32C is CPU-bound
        # on tmpfs; the chunk CRCs combine into the whole-object CRC without a second pass).
        self.ram = RamTier(
            self.config.ram.path,
            keep=self.config.ram.keep,
            verify_threads=min(4, os.cpu_count() or 1),
        )
        self._sidecar_watch: SidecarWatch | None = None
        if slot_provider is None and stager is None:
            # A ready sidecar on the local socket serves slots and staging (strata.sidecar).
            from strata.client.sidecar_client import connect

            sidecar = connect(self.config.socket)
            if sidecar is not None:
                from strata.client.fallback import SidecarFallbackStager

                reuse = LocalSlotProvider(self.ram, keep=self.config.ram.keep, allocate=False)
                slot_provider = ReuseFirstSlotProvider(reuse, sidecar)
                # A restore survives the sidecar going away: direct tier access (issue 11).
                direct = LocalStager(
                    self._restore_tiers,
                    self.ram,
                    LocalSlotProvider(self.ram, keep=self.config.ram.keep),
                    self.config.restore.verify,
                )
                stager = SidecarFallbackStager(sidecar, direct)
            elif self.config.pvc is not None or self.config.gcs is not None:
                # Promotion is the sidecar's job: keep looking for one that starts late.
                self._sidecar_watch = SidecarWatch(
                    self.config.socket,
                    " and ".join(t for t in ("pvc", "gcs") if getattr(self.config, t)),
                )
        self.slot_provider: SlotProvider = slot_provider or LocalSlotProvider(
            self.ram, keep=self.config.ram.keep
        )
        self.stager: Stager = stager or LocalStager(
            self._restore_tiers, self.ram, self.slot_provider, self.config.restore.verify
        )
        self.process_group = process_group
        if reshard is None:
            reshard = os.environ.get(ENV_RESTORE_RESHARD, "") in ("1", "true", "True")
        self.reshard = reshard
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="strata-checksum")
        self.saver = Saver(
            self.ram,
            self.slot_provider,
            job_id=self.job_id,
            rank=self.rank,
            world_size=self.world_size,
            writer_id=self.writer_id,
            every=self.config.ram.every,
            background=self._bg,
            report=self._report,
            copy_threads=copy_threads,
            raise_on_error=raise_on_error,
            register_limit_bytes=register_limit_bytes,
        )
        every = component_every if component_every is not None else self.config.component_every
        if every:
            self.saver.cadence = ComponentCadence(every)
        self._component_steps: dict[str, int] = {}
        self._tiers: list[Tier] | None = None
        self.incarnation = ""
        """The incarnation opened by the last :meth:`restore` (``""`` before any)."""
        self._sharded_load = ShardedLoad(self.rank, self.world_size, self.world_size)
        self._loaded_hint: tuple[int, bool] | None = None
        self._load_quarantined: list[str] = []
        self._tier_notes: list[str] = []
        self.termination = Termination(self)
        """SIGTERM handling and the final flush (:mod:`strata.client.termination`)."""

    # -- tiers ----------------------------------------------------------------------------------

    def _restore_tiers(self) -> list[Tier]:
        if self._tiers is None:

            def leave_out_gcs(exc: Exception) -> None:
                # No credentials or no client library must not stop a restore that RAM or the
                # PVC can serve: the tier is left out and the restore says so.
                note = f"gcs: not searched: {exc}"
                log.warning("strata: %s", note)
                self._tier_notes.append(note)

            durable = durable_tiers(
                self.config, writer_id=self.writer_id, on_gcs_error=leave_out_gcs
            )
            self._tiers = in_restore_order(self.config, self.ram, durable)
        return self._tiers

    # -- save (the save path is :class:`strata.client.saver.Saver`) ---------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a RAM checkpoint (``ram.every``: steps and/or seconds)."""
        return self.saver.should_save(step)

    def save(
        self,
        step: int,
        state: Any,
        blocking: bool = True,
        replicated: bool | Collection[str] | None = None,
    ) -> bool:
        """Snapshot ``state`` as ``step`` into the RAM tier; True when committed there.

        Blocks only for the copy into a RAM slot (the stall, recorded in ``stall_seconds``).
        Returns False after logging and recording a failure (see the module docstring's failure
        policy). Raises ValueError for a step that is not a non-negative int. Storages the slot
        already holds (a frozen base) are not copied again; such a step is committed in the
        background once they are confirmed by CRC32C, and :meth:`wait_copied` returns that
        outcome (:mod:`strata.client.reuse`). A process that never called :meth:`restore` on a
        node where a restore opened an incarnation joins it, or gets False when it runs at
        another world size (the sidecar would never promote its steps;
        :mod:`strata.client.lineage_guard`).

        ``blocking=False`` (overlapped): returns once the copies are enqueued (True) and commits
        when they complete; until :meth:`wait_copied` returns, do not change any tensor of
        ``state`` in place (optimizers in ``state`` wait by themselves before their step; a
        tensor changed anyway makes that step not committed). See :mod:`strata.client.saver`.

        DTensors (FSDP2, tensor parallel, any mesh) are stored as this rank's local chunk; a
        chunk held by several ranks is written once, by an owner every rank computes alike
        (:mod:`strata.format.placement`). ``replicated``: plain tensors that are identical on
        every rank (DDP), also written once: True (every plain tensor) or the top-level keys of
        ``state`` holding them (``{"model", "optim"}``); see
        :func:`strata.format.placement.replicated_rule`. Every rank must then save the same
        tensors in the same order (as SPMD training does).
        """
        inc, why = join_or_refuse(
            self.ram, self.job_id, self.saver.incarnation, self.world_size, step
        )
        if why is not None:  # logged, reported to the sidecar (a failed save), last_error
            self.saver._failed(step, RuntimeError(why))
            return False
        if inc != self.saver.incarnation:
            log.warning("strata: save() before restore(): joining incarnation %s", inc)
            self.incarnation = self.saver.incarnation = inc
        return self.saver.save(step, state, blocking=blocking, replicated=replicated)

    def wait_copied(self, timeout: float | None = None) -> bool | None:
        """Wait for the overlapped save in flight: True committed, False failed (see
        ``last_error``), None when none was in flight."""
        return self.saver.wait_copied(timeout)

    def prepare(self, state: Any, background: bool = False) -> None:
        """Allocate, pre-fault (and, for CUDA state, register) the RAM slots ``state`` needs,
        so that no save pays for them. ``restore()`` does this in the background by itself;
        call it when training starts without a restore. Raises what slot allocation raises
        (:class:`strata.errors.TierFull`, ...) unless ``background``. The state is encoded
        with the saves' cache, so that the first save reuses its layout (issue 14, W3)."""
        enc = self.saver.encode_ahead(state)
        cuda = holds_cuda(enc)
        if background:
            self.saver.prepare_in_background(enc.data_nbytes, cuda)
        else:
            self.saver.prepare(enc.data_nbytes, cuda)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every background checksum pass submitted so far has finished."""
        self.saver.wait(timeout)

    def should_stop(self, step: int | None = None, state: Any = None, agree: bool = True) -> bool:
        """True once the pod got SIGTERM; with ``step`` and ``state`` the first True has saved
        ``step`` (if new) and waited for it to be durable (:mod:`strata.client.termination`)."""
        return self.termination.should_stop(step, state, agree)

    flush = wait

    @property
    def last_error(self) -> str | None:
        """The newest save or checksum failure (None: none yet)."""
        return self.saver.last_error

    @property
    def failed_saves(self) -> int:
        return self.saver.failed_saves

    @property
    def saves(self) -> int:
        return self.saver.saves

    @property
    def last_stall_seconds(self) -> float | None:
        return self.saver.last_stall_seconds

    @property
    def stall_seconds(self) -> list[float]:
        """The stall of every successful save, seconds, in order."""
        return self.saver.stall_seconds

    @property
    def last_saved_step(self) -> int | None:
        return self.saver.last_saved_step

    # -- restore --------------------------------------------------------------------------------

    def _dist(self) -> Any:
        if (
            self.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        ):
            return torch.distributed
        return None

    def _gather(self, obj: Any) -> list[Any]:
        dist = self._dist()
        if dist is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def all_steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending: in ``tier`` ("ram", "pvc", "gcs", "peer"), or restorable
        (None). Raises ValueError for a tier not configured. See :mod:`strata.client.steps`."""
        return _steps.committed_steps(
            self.stager.inventory(self.job_id, self.rank, self.world_size),
            self.world_size,
            tier,
            self.config.tiers_in_restore_order(),
        )

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest of :meth:`all_steps` (``tier`` as there), or None when there is none."""
        return _steps.latest(self.all_steps(tier))

    def restore(self, state: Any, step: int | None = None) -> RestoreResult:
        """Load the newest restorable step into ``state`` in place (see the module docstring).

        ``step``: restore exactly that step (every rank; nearest tier first, verified) instead
        of the newest; :class:`RestoreError` when it is not restorable (no fall back to another
        step nor to a fresh start; :mod:`strata.client.steps`). ValueError for a step that is
        not a non-negative int.

        Returns a :class:`RestoreResult` (``step`` None: fresh start). Raises
        :class:`RestoreError` when nothing is restorable and fresh starts are not allowed, and
        :class:`strata.format.codec.CodecError` when the checkpoint does not fit the live state.
        """
        _steps.check_step(step)
        t0 = time.perf_counter()
        self.wait()
        self.saver.forget_unchanged()  # a restore writes tensors without bumping their versions
        now = datetime.now(UTC)
        proposal = {"id": new_incarnation_id(now), "created": now.isoformat()}
        chosen: dict[str, str] | None = None
        excluded: list[int] = []
        clobbered = False
        self._load_quarantined = []  # copies this restore's loads found corrupt (reported)
        self._restore_tiers()
        notes: list[str] = list(self._tier_notes)
        if self.world_size > 1 and self._dist() is None:
            notes.append(
                f"world size {self.world_size} without torch.distributed: other ranks' RAM tiers "
                "cannot be seen, so only the PVC and GCS can serve a complete step; call "
                "torch.distributed.init_process_group() before restore()"
            )
        cand = None
        if self.reshard:
            mine = reshard_candidate(self._restore_tiers(), self.job_id, self.world_size)
            cand = _steps.pin_candidate(self._gather(mine)[0], step)
        for _ in range(64):
            inv = self.stager.inventory(self.job_id, self.rank, self.world_size)
            gathered = self._gather({"inventory": inv.to_dict(), "incarnation": proposal})
            invs = _steps.pin_step(
                [RankInventory.from_dict(g["inventory"]) for g in gathered], step
            )
            # Every rank takes rank 0's proposal: one incarnation id for the whole world.
            chosen = chosen or gathered[0]["incarnation"]
            for note in skipped_partial_steps(invs) + [n for i in invs for n in i.notes]:
                if note not in notes:
                    notes.append(note)
                    log.warning("strata restore: %s", note)
            plan = plan_restore(
                invs, self.world_size, self.config.tiers_in_restore_order(), excluded
            )
            if cand is not None and (plan is None or cand[0] > plan.step):
                assert chosen is not None
                resharded = self._reshard(state, cand[0], cand[1], notes, t0, chosen)
                if resharded is not None:
                    return resharded
                cand = None
                continue
            if plan is None:
                break
            try:
                res: StageResult | None = self.stager.stage(
                    self.job_id, plan.step, self.rank, self.world_size, plan.sources[self.rank]
                )
                err = None
            except StageError as exc:
                res, err = None, str(exc)
                notes.extend(exc.skipped)
            except Exception as exc:  # stay in lockstep with the other ranks: fail this step only
                res, err = None, f"staging failed: {exc!r}"
                notes.append(f"step {plan.step}: {err}")
            outcomes = self._gather(None if res is None else res.tier)
            if res is None or any(o is None for o in outcomes):
                log.warning(
                    "strata restore: step %d could not be staged on every rank (%s); re-planning "
                    "without it",
                    plan.step,
                    err or "another rank failed",
                )
                excluded.append(plan.step)
                continue
            for note in res.skipped:
                if note not in notes:
                    notes.append(note)
            failure: BaseException | None = None
            try:
                tree, load_err = self._load(state, plan.step, res.tier, notes), None
            except ShardCorrupt as exc:
                tree, load_err, clobbered, failure = None, f"{res.tier}: {exc}", True, exc
                notes.append(f"{load_err} (quarantined)")
                self._load_quarantined.append(res.tier)
                try:
                    self.ram.quarantine(self.job_id, plan.step, self.rank, str(exc))
                except TierError as qexc:
                    notes.append(f"ram: quarantine failed: {qexc}")
            except Exception as exc:  # any other failure: every rank learns of it (no hang)
                tree, load_err, failure = None, f"{res.tier}: {exc!r}", exc
            if not settle_load(self._gather(load_failure(failure)), self.rank, plan.step, failure):
                # A copy failed verification while loading (here or on another rank): every
                # rank plans again; the quarantined copy is no longer listed.
                log.warning(
                    "strata restore: step %d failed to load (%s); re-planning",
                    plan.step,
                    load_err or "on another rank",
                )
                continue
            assert chosen is not None
            self._open_incarnation(chosen, plan.incarnation or None, plan.step, notes)
            self._finish_sharded(self._sharded_load, plan.step, notes)
            result = RestoreResult(
                step=plan.step,
                tiers={r: t for r, t in enumerate(outcomes)}
                if len(outcomes) > 1
                else {self.rank: res.tier},
                nbytes=res.nbytes,
                seconds=time.perf_counter() - t0,
                skipped=notes,
                state=tree,
                component_steps=dict(self._component_steps),
            )
            if self._component_steps:
                log.warning(
                    "strata: step %d holds components from earlier steps (own cadence): %s",
                    plan.step,
                    self._component_steps,
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
            self._report_restore(result, "restored")
            self._prepare_after_load(state)
            return result
        searched = ", ".join(
            f"{t}={self._tier_location(t)}" for t in self.config.tiers_in_restore_order()
        )
        if step is not None:
            self._report_restore(
                RestoreResult(None, {}, 0, time.perf_counter() - t0, notes), "failed"
            )
            raise _steps.not_restorable(self.job_id, step, self.world_size, searched, notes)
        if self.config.restore.allow_fresh_start and clobbered:
            self._report_restore(
                RestoreResult(None, {}, 0, time.perf_counter() - t0, notes), "failed"
            )
            raise RestoreError(
                f"no verifying copy of job {self.job_id!r} is left, and a corrupt copy was "
                "partly loaded into the live state before its checksum failed, so a fresh start "
                "would train from mixed weights: re-create the model and optimizer and call "
                f"restore() again (notes: {'; '.join(notes)})"
            )
        if self.config.restore.allow_fresh_start:
            log.warning(
                "strata: NO restorable checkpoint for job %s (searched %s); starting from scratch "
                "because restore.allow_fresh_start is set",
                self.job_id,
                searched,
            )
            self._open_incarnation(chosen or proposal, None, None, notes)
            fresh = RestoreResult(None, {}, 0, time.perf_counter() - t0, notes, state)
            self._report_restore(fresh, "fresh-start")
            self._prepare_quietly(state)
            return fresh
        self._report_restore(RestoreResult(None, {}, 0, time.perf_counter() - t0, notes), "failed")
        raise RestoreError(
            f"no restorable checkpoint for job {self.job_id!r} with world size {self.world_size} "
            f"(searched {searched}; excluded after failed staging: {excluded or 'none'}; notes: "
            f"{'; '.join(notes) or 'none'}). Set restore.allowFreshStart in the CheckpointPolicy "
            "(or allow_fresh_start=True) to start from scratch"
        )

    def _prepare_after_load(self, state: Any) -> None:
        """Slots for the next save, in the background, sized by the shard just loaded (the live
        state now has its tree; encoding the state again only to size them cost ~30 us per
        tensor on the restore path); a save that needs more prepares again
        (``Saver._after_save``)."""
        hint, self._loaded_hint = self._loaded_hint, None
        if hint is None or hint[0] <= 0:
            self._prepare_quietly(state)
            return
        self.saver.prepare_in_background(hint[0], hint[1])

    def _prepare_quietly(self, state: Any) -> None:
        """Slots for the next save, in the background (never fails the restore)."""
        try:
            self.prepare(state, background=True)
        except Exception as exc:  # an unsupported value: the first save will say so
            log.debug("strata: slots not prepared after restore: %s", exc)

    def _open_incarnation(
        self, chosen: dict[str, str], parent: str | None, base_step: int | None, notes: list[str]
    ) -> None:
        """Open the incarnation agreed in the restore all-gather: from now on every manifest
        carries its id. Its record (identical bytes on every rank) goes into this node's RAM
        tier (every rank; the sidecar copies it next to the steps it commits), and rank 0 also
        writes it to the shared tiers now, so the lineage survives the loss of every node."""
        rec = Incarnation(
            job_id=self.job_id,
            id=chosen["id"],
            parent=parent,
            base_step=base_step,
            world_size=self.world_size,
            created=datetime.fromisoformat(chosen["created"]),
        )
        targets: list[Tier] = [self.ram]
        if self.rank == 0:
            targets += [t for t in self._restore_tiers() if t.name != "ram"]
        for tier in targets:
            try:
                write_incarnation(tier, rec)
            except Exception as exc:  # the lineage is also carried by the sidecars' commits
                note = f"{tier.name}: incarnation record {rec.id} not written: {exc}"
                log.warning("strata restore: %s", note)
                notes.append(note)
        self.incarnation = rec.id
        self.saver.incarnation = rec.id
        log.info(
            "strata: job %s rank %d opened incarnation %s (parent %s, resumed from step %s)",
            self.job_id,
            self.rank,
            rec.id,
            parent,
            base_step,
        )

    def _report(self, event: ClientEvent) -> None:
        """Hand a save/restore event to the sidecar (off the training thread; best effort)."""
        self._bg.submit(self.stager.report, event)

    def _report_restore(
        self, result: RestoreResult, outcome: Literal["restored", "fresh-start", "failed"]
    ) -> None:
        self._report(
            RestoreEvent(
                job_id=self.job_id,
                rank=self.rank,
                outcome=outcome,
                step=result.step,
                tier=result.tiers.get(self.rank, result.tier),
                nbytes=result.nbytes,
                seconds=result.seconds,
                skipped=result.skipped[:16],
                quarantined=list(self._load_quarantined),
            )
        )

    def _tier_location(self, tier: str) -> str:
        if tier == "ram":
            return self.config.ram.path
        if tier == "pvc" and self.config.pvc is not None:
            return self.config.pvc.path
        if tier == "gcs" and self.config.gcs is not None:
            return f"gs://{self.config.gcs.bucket}/{self.config.gcs.prefix}"
        if tier == "peer" and self.config.peers is not None:
            return f"{len(self.config.peers.peers)} peers (through the sidecar)"
        return "?"

    def _load(self, state: Any, step: int, tier: str, notes: list[str]) -> Any:
        """Load this rank's staged RAM shard of ``step`` into ``state`` (one pass: verify while
        copying when the stager left a RAM hit unverified; :mod:`strata.client.loader`).
        Sharded tensors not in this shard come from their owners or the tiers
        (:meth:`_finish_sharded`, called by restore once every rank loaded). Raises :class:`ShardCorrupt` (the live state is then partly
        overwritten) and :class:`RestoreError` (some rank could not load its sharded tensors)."""
        load = ShardedLoad(self.rank, self.world_size, self.world_size)
        deferred = tier == self.ram.name and self.stager.defers_in_place_verify
        with SlotLease(self.ram, self.job_id, step, self.rank) as lease:
            m = lease.manifest
            assert m is not None
            self._component_steps = dict(m.component_steps or {})
            verify = deferred and self.config.restore.verify and m.verified
            mapped = self.saver.mapping_of(lease.path)
            if mapped is not None and len(mapped) < m.data_nbytes:
                mapped = None  # mapped before the slot grew: the loader maps it itself
            out = load_shard(
                state,
                m,
                lease.path,
                pool=self.saver.copy_pool,
                workers=self.saver.copy_threads,
                verify=verify,
                # A shard its stager verified (or a policy without verification) is copied
                # only; one without checksums yet is checksummed on the way.
                checksum=verify or not m.verified,
                mapped=mapped,
                device_source=lambda: self.saver.host_view(lease.path),
                resolve=load.resolve,
            )
            if deferred and not m.verified and m.data_nbytes:
                self.ram.update_checksums(
                    self.job_id, step, self.rank, out.chunk_crc32c, out.crc32c
                )
                notes.append(
                    f"ram: step {step} rank {self.rank} had no checksums yet (its writer stopped "
                    "before the checksum pass); checksummed now, not verified against an "
                    "earlier record"
                )
        self._sharded_load = load
        # Sharded tensors go to the resharding restore, not the loader: their device is unknown
        # here, so such a state is sized by encoding it (after the load, as before).
        self._loaded_hint = None if m.sharded else (m.data_nbytes, out.cuda)
        return out.tree

    def _finish_sharded(self, load: ShardedLoad, step: int, notes: list[str]) -> None:
        """Replicas from their owners (point to point), then other slices from the tiers; every
        rank learns whether every rank succeeded (RestoreError otherwise)."""
        err = None
        try:
            load.exchange(self.process_group)
            if load.pending:
                reader = ShardReader(self._restore_tiers(), self.job_id, step)
                try:
                    load.fill_from_tiers(reader)
                finally:
                    notes.extend(reader.notes)
                    reader.close()
        except Exception as exc:  # any failure (a device copy, NCCL): every rank learns of it
            err = exc
        errors = self._gather(None if err is None else f"rank {self.rank}: {err}")
        if err is not None:
            raise err
        failed = [e for e in errors if e is not None]
        if failed:
            raise RestoreError(f"step {step}: sharded tensors could not be loaded: {failed[0]}")

    def _reshard(
        self,
        state: Any,
        step: int,
        saved_world: int,
        notes: list[str],
        t0: float,
        chosen: dict[str, str],
    ) -> RestoreResult | None:
        """Restore ``step``, written by ``saved_world`` ranks, at this world size (resharding).

        Rank r loads its per-rank values (non-sharded tensors, RNG, dataloader state) from saved
        rank r when that rank existed, else from saved rank ``r % saved_world`` (noted); every
        sharded tensor gets the slice this rank holds now from the saved owners' shards.
        Returns None (noted) when some rank could not load it.
        """
        src = self.rank if self.rank < saved_world else self.rank % saved_world
        reader = ShardReader(self._restore_tiers(), self.job_id, step)
        load = ShardedLoad(self.rank, self.world_size, saved_world)
        err = None
        tree: Any = None
        parent = ""
        try:
            m = reader.manifest(src)
            parent = m.incarnation
            data = reader.read(src, 0, m.data_nbytes)
            tree = codec.load_into(
                state, m, data, where=f"step {step} rank {src}", resolve=load.resolve
            )
            load.fill_from_tiers(reader)
        except Exception as exc:  # any failure (a device copy, NCCL): every rank learns of it
            err = f"rank {self.rank}: {exc}"
        finally:
            notes.extend(n for n in reader.notes if n not in notes)
            reader.close()
        errors = [e for e in self._gather(err) if e is not None]
        if errors:
            note = f"step {step} (world size {saved_world}) could not be resharded: {errors[0]}"
            log.warning("strata restore: %s", note)
            notes.append(note)
            return None
        if src != self.rank:
            notes.append(
                f"rank {self.rank} did not exist in step {step} (world size {saved_world}): its "
                f"per-rank values (non-sharded tensors, RNG, dataloader state) are rank {src}'s"
            )
        if saved_world > self.world_size:
            notes.append(
                f"the per-rank values (non-sharded tensors, RNG, dataloader state) of saved ranks "
                f"{self.world_size}-{saved_world - 1} of step {step} are not restored: no rank "
                "of this world size takes them"
            )
        notes.append(f"step {step} resharded from world size {saved_world} to {self.world_size}")
        self._open_incarnation(chosen, parent or None, step, notes)
        result = RestoreResult(
            step=step,
            tiers={self.rank: "reshard"},
            nbytes=reader.nbytes_read,
            seconds=time.perf_counter() - t0,
            skipped=notes,
            state=tree,
        )
        log.warning(
            "strata: restored step %d of job %s rank %d by resharding from world size %d "
            "(%d bytes read, %.3f s)",
            step,
            self.job_id,
            self.rank,
            saved_world,
            reader.nbytes_read,
            result.seconds,
        )
        self._report_restore(result, "restored")
        return result

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for background checksums, stop the threads, unmap the slots."""
        if self._sidecar_watch is not None:
            self._sidecar_watch.stop()
        self.termination.close()
        try:
            self.wait()
        finally:
            self._bg.shutdown(wait=True)
            self.saver.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _build_config(
    config: StrataConfig | None,
    job_id: str | None,
    ram_dir: str | os.PathLike[str] | None,
    pvc_dir: str | os.PathLike[str] | None,
    keep: int | None,
    every_steps: int | None,
    allow_fresh_start: bool | None,
) -> StrataConfig:
    if config is None:
        # The environment and the arguments are merged, then validated once: a bad setting in
        # either is an error naming it, never silently dropped (nor is STRATA_PVC_DIR).
        raw: dict[str, Any] = dict(StrataConfig.raw_from_env())
    else:
        raw = config.model_dump(mode="json", exclude_defaults=True)
    if job_id is not None:
        raw["job_id"] = job_id
    ram = dict(raw.get("ram", {}))
    if ram_dir is not None:
        ram["path"] = str(ram_dir)
    if keep is not None:
        ram["keep"] = keep
    if every_steps is not None:
        ram["every"] = {"steps": every_steps}
    raw["ram"] = ram
    if pvc_dir is not None:
        raw["pvc"] = {**raw.get("pvc", {}), "path": str(pvc_dir)}
    if allow_fresh_start is not None:
        raw["restore"] = {**raw.get("restore", {}), "allow_fresh_start": allow_fresh_start}
    return StrataConfig.parse(raw)


def _identity(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    else:
        r, w = _env_int("RANK") or 0, _env_int("WORLD_SIZE") or 1
    return (r if rank is None else rank), (w if world_size is None else world_size)
