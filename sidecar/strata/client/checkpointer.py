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
stage is excluded and the ranks re-plan together. A newer step written at another world size is
resharded by default when its state allows it, from any tier holding every shard of it
(:mod:`strata.restore.reshard`). No restorable step: a fresh start (step None)
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
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from strata.client import steps as _steps
from strata.client.cadence import ComponentCadence
from strata.client.collectives import RestoreCollectives
from strata.client.cuda_host import holds_cuda
from strata.client.late_sidecar import SidecarWatch
from strata.client.lineage_guard import join_or_refuse
from strata.client.restore_load import RankLoader, RestoreTiers
from strata.client.restorer import Restorer, RestoreResult, SlotsAfter
from strata.client.saver import Saver
from strata.client.stager import LocalStager, Stager
from strata.client.termination import Termination
from strata.config import StrataConfig
from strata.errors import ConfigError
from strata.protocol import ClientEvent
from strata.restore.reshard import ReshardPolicy
from strata.tiers.base import Tier
from strata.tiers.medium import check_ram_medium
from strata.tiers.ram import RamTier
from strata.tiers.slots import LocalSlotProvider, ReuseFirstSlotProvider, SlotProvider

__all__ = ["Checkpointer", "RestoreResult"]

log = logging.getLogger("strata.client")


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
    ``reshard`` / ``reshard_per_rank``: whether :meth:`restore` loads a step written at another
    world size when it is the newest restorable step (:mod:`strata.restore.reshard`;
    docs/architecture.md "Sharded state"). Default (None, None; env
    ``STRATA_RESTORE_RESHARD`` / ``STRATA_RESTORE_RESHARD_PER_RANK`` unset): reshard when every
    tensor of the step is a DTensor or declared replicated and no value belongs to one rank,
    else raise :class:`strata.restore.reshard.ReshardRefused` naming the per-rank values.
    ``reshard_per_rank=True``: take those values by
    :data:`strata.restore.reshard.PER_RANK_RULE` instead. ``reshard=True`` (the opt-in of
    earlier versions): the same as ``reshard_per_rank=True``. ``reshard=False``: never reshard
    (such a step is skipped and noted); with ``reshard_per_rank=True`` a ConfigError.
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
        reshard_per_rank: bool | None = None,
    ) -> None:
        self.config = _build_config(
            config, job_id, ram_dir, pvc_dir, keep, every_steps, allow_fresh_start
        )
        self.job_id = self.config.job_id
        self.rank, self.world_size = _identity(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        self.writer_id = f"{self.config.pod_writer_id}/rank-{self.rank}"
        # A RAM directory on a disk is refused outside Kubernetes (strata.tiers.medium).
        check_ram_medium(self.config.ram.path, who="Checkpointer")
        # Training waits for a restore: verify a RAM shard with every core (CRC32C is CPU-bound
        # on tmpfs; the chunk CRCs combine into the whole-object CRC without a second pass).
        self.ram = RamTier(
            self.config.ram.path,
            keep=self.config.ram.keep,
            verify_threads=min(4, os.cpu_count() or 1),
        )
        peer: Callable[[Callable[[str], None]], Tier | None] | None = None
        self._sidecar_watch: SidecarWatch | None = None
        if slot_provider is None and stager is None:
            # A ready sidecar on the local socket serves slots and staging (strata.sidecar).
            from strata.client.sidecar_client import connect

            sidecar = connect(self.config.socket)
            if sidecar is not None:
                from strata.client.fallback import SidecarFallbackStager

                reuse = LocalSlotProvider(self.ram, keep=self.config.ram.keep, allocate=False)
                slot_provider = ReuseFirstSlotProvider(reuse, sidecar)
                # A restore survives the sidecar going away: direct tier access.
                direct = LocalStager(
                    self._restore_tiers,
                    self.ram,
                    LocalSlotProvider(self.ram, keep=self.config.ram.keep),
                    self.config.restore.verify,
                )
                stager = SidecarFallbackStager(sidecar, direct)
                if self.config.peers is not None:
                    # Only the sidecar reaches the peers (it holds their TLS material).
                    from strata.client.peer_source import peer_source

                    peer = partial(peer_source, sidecar, self.config)
            elif self.config.pvc is not None or self.config.gcs is not None:
                # Promotion is the sidecar's job: keep looking for one that starts late.
                self._sidecar_watch = SidecarWatch(
                    self.config.socket,
                    " and ".join(
                        t
                        for t, tier in (("pvc", self.config.pvc), ("gcs", self.config.gcs))
                        if tier is not None
                    ),
                )
        self.tiers = RestoreTiers(self.config, self.ram, self.writer_id, peer)
        """The tiers a restore reads (built on first use)."""
        self.slot_provider: SlotProvider = slot_provider or LocalSlotProvider(
            self.ram, keep=self.config.ram.keep
        )
        self.stager: Stager = stager or LocalStager(
            self._restore_tiers, self.ram, self.slot_provider, self.config.restore.verify
        )
        self.process_group = process_group
        self.reshard = ReshardPolicy.from_options(reshard, reshard_per_rank)
        """When :meth:`restore` reshards (:class:`strata.restore.reshard.ReshardPolicy`)."""
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
        self.incarnation = ""
        """The incarnation opened by the last :meth:`restore` (``""`` before any)."""
        self.restorer = Restorer(
            self.config,
            self.ram,
            self.stager,
            self.tiers,
            RestoreCollectives(self.rank, self.world_size, process_group),
            RankLoader(
                self.ram,
                self.job_id,
                self.rank,
                self.world_size,
                verify=self.config.restore.verify,
                buffers=self.saver,
                tiers=self._restore_tiers,
                stager_deferred=lambda: self.stager.defers_in_place_verify,
            ),
            rank=self.rank,
            world_size=self.world_size,
            reshard=self.reshard,
            report=self._report,
            on_incarnation=self._set_incarnation,
        )
        """The restore (:mod:`strata.client.restorer`; its phases: :mod:`strata.client.collectives`)."""
        self.termination = Termination(self)
        """SIGTERM handling and the final flush (:mod:`strata.client.termination`)."""

    # -- tiers ----------------------------------------------------------------------------------

    def _restore_tiers(self) -> list[Tier]:
        """The tiers a restore reads, nearest first (:class:`strata.client.restore_load.RestoreTiers`)."""
        return self.tiers.get()

    # -- save (the save path is :class:`strata.client.saver.Saver`) ---------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a RAM checkpoint (``ram.every``: steps and/or seconds)."""
        return self.saver.outcomes.should_save(step)

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
            self.saver.outcomes.failed(step, RuntimeError(why))
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
        with the saves' cache, so that the first save reuses its layout."""
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
        return self.saver.outcomes.last_error

    @property
    def failed_saves(self) -> int:
        return self.saver.outcomes.failed_saves

    @property
    def saves(self) -> int:
        return self.saver.outcomes.saves

    @property
    def last_stall_seconds(self) -> float | None:
        return self.saver.outcomes.last_stall_seconds

    @property
    def stall_seconds(self) -> list[float]:
        """The stall of every successful save, seconds, in order."""
        return self.saver.outcomes.stall_seconds

    @property
    def last_saved_step(self) -> int | None:
        return self.saver.outcomes.last_saved_step

    # -- restore (the restore is :class:`strata.client.restorer.Restorer`) ---------------------

    def all_steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending: in ``tier`` ("ram", "pvc", "gcs", "peer"), or restorable
        (None). Raises ValueError for a tier not configured. See :mod:`strata.client.steps`.
        Steps written at another world size are not listed, although :meth:`restore` reshards
        the newest of them by default when it is newer (:mod:`strata.restore.reshard`)."""
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
        out = self.restorer.restore(state, step, t0)
        self._prepare_after_restore(state, out.slots)
        return out.result

    def _prepare_after_restore(self, state: Any, slots: SlotsAfter) -> None:
        """Slots for the next save, in the background. Sized by the shard just loaded when the
        restore knows it (the live state now has its tree; encoding the state again only to
        size them cost ~30 us per tensor on the restore path); a save that needs more prepares
        again (``Saver._after_save``). Never fails the restore."""
        if slots == "none":
            return
        if slots != "from-state":
            self.saver.prepare_in_background(*slots)
            return
        try:
            self.prepare(state, background=True)
        except Exception as exc:  # an unsupported value: the first save will say so
            log.debug("strata: slots not prepared after restore: %s", exc)

    def _set_incarnation(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self.saver.incarnation = incarnation

    def _report(self, event: ClientEvent) -> None:
        """Hand a save/restore event to the sidecar (off the training thread; best effort)."""
        self._bg.submit(self.stager.report, event)

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

    def __exit__(self, *exc: object) -> None:
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
