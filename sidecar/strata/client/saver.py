"""The save path of the training client: :class:`Saver` (one rank's saves into the RAM tier).

``save(step, state)`` encodes the state (:mod:`strata.format.codec`), takes a free slot of the
RAM ring (:mod:`strata.tiers.slots`), copies every tensor storage into it (several threads),
commits the step in the RAM tier with a manifest *without* checksums, and returns: the stall is
the copy. A background thread then checksums the slot and atomically rewrites the manifest with
its CRC32Cs (:meth:`strata.tiers.ram.RamTier.seal`) and the per-storage "unchanged since" hint
(:mod:`strata.client.unchanged`); promotion only takes checksummed shards.
The failure policy is :class:`strata.client.checkpointer.Checkpointer`'s (its module docstring).

Overlapped mode, ``save(step, state, blocking=False)``: encodes the state, takes a
slot, *enqueues* the copies (CUDA: non-blocking device-to-host copies on a side stream into the
registered slot; CPU: the copy threads, started in the background) and returns. The step is
committed by a background thread when the copies complete. The contract:

- until :meth:`Saver.wait_copied` returns, the caller must not change any tensor of ``state``
  in place (the optimizer step, an in-place buffer update in ``forward``, ``load_state_dict``);
  reading them (forward/backward) is fine;
- enforced where it can be: every ``torch.optim.Optimizer`` found in ``state`` gets a step
  pre-hook that calls ``wait_copied()`` (so ``optimizer.step()`` waits for the copy by itself),
  the next ``save()`` waits too, and at commit every tensor's version counter is compared with
  its value at enqueue: a tensor changed in place meanwhile makes the step NOT committed
  (:class:`strata.errors.StateChanged`, logged and recorded like any failed save; the previous
  step is intact). Changes the version counter cannot see (writes through ``.data`` or through
  another process) are not detected.

Storages left in place (:mod:`strata.client.reuse`): a blocking save into a slot
that already holds some storages' live bytes (a frozen base saved into the same slot one ring
turn ago) copies only the others. Such a save returns True once the changed bytes are copied;
its commit follows in the background after the bytes left in place are confirmed by CRC32C
against the live ones, so the step becomes visible (and ``saves`` / ``last_saved_step`` move)
a little later; :meth:`Saver.wait_copied` returns its outcome, and :meth:`Saver.wait` and the
next ``save()`` wait for it. A confirmation that fails (a write the version counter did not
see) makes the step a failed save, logged and counted like any other; the previous step is
intact. ``last_copied_nbytes`` says how many bytes the newest save wrote. An overlapped save
leaves bytes in place the same way; its :meth:`Saver.wait_copied` (and so the optimizer's
pre-hook) then waits for the confirmation too. States holding CUDA tensors are always copied
in full.

``prepare(nbytes)`` allocates, maps with ``MAP_POPULATE`` (and registers with CUDA) every slot
of the ring before a save needs it: the checkpointer calls it in the background at ``restore()``
and after the first save, so no save pays slot allocation or first-touch page faults.

The parts: :mod:`strata.client.slot_ring` (the mapped slot ring), :mod:`strata.client.background`
(the background thread and the checksum pass), :mod:`strata.client.outcomes` (counts, stalls,
errors, save events, the interval), :mod:`strata.client.versions` (version counters, optimizer
hooks) and :mod:`strata.client.reuse` (storages left in place). :class:`Saver` encodes, copies
and commits.
"""

from __future__ import annotations

import gc
import logging
import mmap
import time
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from strata.client.background import BackgroundWork, Checksum, ChecksumPass
from strata.client.cadence import ComponentCadence
from strata.client.cuda_host import CopyHandle, HostRegistry, RegisteredSlotMaps, copy_to_host
from strata.client.outcomes import SaveOutcomes
from strata.client.reuse import SlotReuse
from strata.client.slot_commit import CopiedSlot, SlotCommit
from strata.client.slot_ring import SlotRing
from strata.client.unchanged import storage_signatures
from strata.client.versions import OptimizerHooks, check_unchanged, versions
from strata.config import Interval
from strata.format import codec
from strata.format.encode_cache import EncodeCache
from strata.protocol import ClientEvent
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotProvider, SlotWriteLock

log = logging.getLogger("strata.client")


class Saver:
    """Saves of one rank (``job_id``, ``rank`` of ``world_size``) into the RAM tier ``ram``.

    ``slot_provider``: where slots come from (in process, or the sidecar). ``every``: the RAM
    tier's interval (:meth:`strata.client.outcomes.SaveOutcomes.should_save`). ``writer_id``:
    stamped into every manifest. ``background``: the single thread running checksum passes (and
    the client's reports, so that a report never overtakes the checksum of its step).
    ``report``: receives one :class:`strata.protocol.SaveEvent` per save. ``copy_threads``:
    threads copying into a slot. ``raise_on_error``: raise every save failure instead of
    returning False. ``register_limit_bytes``: the most slot bytes page-locked with CUDA at
    once (None: the driver's limits only); see :mod:`strata.client.cuda_host`.
    """

    def __init__(
        self,
        ram: RamTier,
        slot_provider: SlotProvider,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        writer_id: str,
        every: Interval,
        background: Executor,
        report: Callable[[ClientEvent], None],
        copy_threads: int = 4,
        raise_on_error: bool = False,
        register_limit_bytes: int | None = None,
    ) -> None:
        self.ram = ram
        self.slot_provider = slot_provider
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.writer_id = writer_id
        self.raise_on_error = raise_on_error
        self.outcomes = SaveOutcomes(job_id, rank, every, report)
        """Counts, stalls, the newest error; one save event per save (:mod:`.outcomes`)."""
        self.slots = SlotRing(ram, slot_provider, job_id, rank, register_limit_bytes)
        """This rank's mapped slot ring (:mod:`strata.client.slot_ring`)."""
        self._bg = background
        self.background = BackgroundWork(background)
        self._overlap = ThreadPoolExecutor(1, thread_name_prefix="strata-overlap")
        self._inflight: Future[bool] | None = None
        self._hooks = OptimizerHooks(self.wait_copied)
        self._enc_cache = EncodeCache()
        self.copy_threads = max(1, copy_threads)
        self.copy_pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="strata-copy")
        """The copy threads (saves; restores use them too: training waits for both)."""
        self.reuse = SlotReuse(ram, job_id, rank)
        """What each slot holds (:mod:`strata.client.reuse`); ``reuse.enabled = False`` copies
        every storage on every save."""
        self.checksums = ChecksumPass(ram, job_id, rank, self.reuse, self.outcomes)
        self.committer = SlotCommit(
            ram,
            job_id=job_id,
            rank=rank,
            world_size=world_size,
            writer_id=writer_id,
            reuse=self.reuse,
            checksums=self.checksums,
            copy_pool=self.copy_pool,
            copy_threads=self.copy_threads,
        )
        """Manifests and commits into the RAM tier (:mod:`strata.client.slot_commit`)."""
        self.last_copied_nbytes: int | None = None
        """Bytes the newest save wrote into its RAM slot (storages left in place are not
        written: :mod:`strata.client.reuse`)."""
        self.cadence: ComponentCadence | None = None
        """Slow components (:mod:`strata.client.cadence`); set by the checkpointer."""
        self.overlap_wait_seconds: list[float] = []
        """Per :meth:`wait_copied` that found a copy in flight, how long it blocked, seconds."""

    # -- what the saves did: ``outcomes`` (:class:`strata.client.outcomes.SaveOutcomes`) ------

    @property
    def last_error(self) -> str | None:
        """The newest failure of a save or of a background checksum pass (None: none yet)."""
        return self.outcomes.last_error

    @property
    def incarnation(self) -> str:
        """Stamped into every manifest: the incarnation :meth:`Checkpointer.restore` opened
        (``""`` before any restore: shards of no incarnation)."""
        return self.committer.incarnation

    @incarnation.setter
    def incarnation(self, value: str) -> None:
        self.committer.incarnation = value

    @property
    def host(self) -> HostRegistry:
        """Page-locked host memory of the slots (:mod:`strata.client.cuda_host`)."""
        return self.slots.host

    @property
    def _maps(self) -> RegisteredSlotMaps:
        return self.slots.maps

    # -- save -----------------------------------------------------------------------------------

    def save(
        self, step: int, state: Any, *, blocking: bool, replicated: bool | Collection[str] | None
    ) -> bool:
        """Snapshot ``state`` as ``step`` into the RAM tier (the options and their defaults:
        :meth:`strata.client.Checkpointer.save`).

        ``blocking``: True returns when the step is committed in RAM (True) or the save failed
        (False); the stall is the copy. A save that left unchanged storages in place returns
        True after the copy of the rest; its commit follows in the background (module
        docstring; :meth:`wait_copied` gives the outcome). False (overlapped, see the module docstring) returns
        True once the copies are enqueued; the outcome is :meth:`wait_copied`'s. Each stall
        (time this call blocked) is recorded in ``stall_seconds``. Failures follow the module
        docstring's policy. Raises ValueError for a step that is not a non-negative int.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        self.wait_copied()  # one save in flight at a time
        # Encoding allocates several objects per tensor; with the cyclic collector on, that
        # triggers collections that walk the whole heap: half of the stall of a 10,000-tensor
        # state (bench W3: 0.46 -> 0.22 s). Nothing cyclic is created here.
        collect = gc.isenabled()
        gc.disable()
        try:
            if self.cadence is not None:
                state, slow = self.cadence.apply(step, state)
                if slow:
                    self.committer.component_steps[step] = slow
            deferred = not blocking
            checksum = None
            if blocking:
                nbytes, deferred, checksum = self._save(step, state, replicated, t0)
            else:
                self._enqueue(step, state, t0, replicated)
                nbytes = 0
        except Exception as exc:
            if collect:
                gc.enable()
            self.outcomes.failed(step, exc)
            if self.raise_on_error:
                raise
            return False
        try:
            stall = time.perf_counter() - t0
            if checksum is not None:
                # Started only now: the background pass holds the GIL for a while (per-tensor
                # Python), which would otherwise slow the end of this save down (bench W3).
                # Before the report, which must never overtake its step's checksum.
                self.checksums.start(self.background, checksum)
            if not deferred:
                self.outcomes.succeeded(step, stall)
            else:
                self.outcomes.last_stall_seconds = stall
            if blocking:
                self._after_save(nbytes)
        finally:
            if collect:
                gc.enable()
        return True

    def _encode(self, state: Any, replicated: bool | Collection[str] | None) -> codec.EncodedState:
        return codec.encode(
            state,
            cache=self._enc_cache,
            rank=self.rank,
            world_size=self.world_size,
            replicated=replicated,
        )

    def encode_ahead(self, state: Any) -> codec.EncodedState:
        """Encode ``state`` as a save would (with the saves' cache) and serialise its layout's
        JSON, so that the first save of that state replays the layout instead of paying the
        per-tensor work (bench W3: ~0.3 s of a first save). Raises what encoding raises."""
        enc = self._encode(state, None)
        if enc.layout is not None:
            enc.layout.json.json()
        return enc

    def _save(
        self, step: int, state: Any, replicated: bool | Collection[str] | None, t0: float
    ) -> tuple[int, bool, Checksum | None]:
        """Copy and commit (or, with storages left in place, copy and hand the commit to the
        background confirmation: then True); returns (data bytes, deferred, the checksum pass
        to start: :meth:`ChecksumPass.start`)."""
        enc = self._encode(state, replicated)
        slot, stream, dst = self._take_slot(step, enc)
        deferred = False
        checksum = None
        try:
            try:
                copy_to_host(enc, dst, self.copy_pool, stream, skip=slot.skip).wait()
                slot.addr = dst.data_ptr()
            finally:
                del dst
            self.last_copied_nbytes = slot.copied_nbytes
            if slot.skip:
                slot.sigs = storage_signatures(enc.live, slot.versions, enc.sources)  # as copied
                stall = time.perf_counter() - t0
                self._inflight = self.background.submit(self._confirm, slot, stall)
                deferred = True
            else:
                checksum = self.committer.commit(slot)
        finally:
            if not deferred:
                slot.lock.release()
        return enc.data_nbytes, deferred, checksum

    def _take_slot(
        self, step: int, enc: codec.EncodedState
    ) -> tuple[CopiedSlot, Any, torch.Tensor]:
        """Write-lock a slot for ``enc`` and plan the copy: (the slot to copy ``step`` into,
        with the live tensors' version counters and the storages left in place; the side
        stream or None; a uint8 tensor over the slot's mapping). Releases the lock on error."""
        stream = self.slots.stream(enc)
        valid = self.reuse.validate()
        lock = SlotWriteLock.acquire(self.slot_provider, self.job_id, self.rank, enc.data_nbytes)
        try:
            rec = self.reuse.take(lock.identity, valid)  # before anything writes into the slot
            live_versions = versions(enc.live)
            # CUDA states are always copied in full: confirming needs their bytes on the host
            skip = self.reuse.plan(rec, enc, live_versions) if stream is None else frozenset()
            dst = torch.frombuffer(self.slots.mapping(lock), dtype=torch.uint8)
        except BaseException:
            lock.release()
            raise
        return CopiedSlot(step, enc, lock, live_versions, skip), stream, dst

    def _confirm(self, slot: CopiedSlot, stall: float) -> bool:
        """Background: :meth:`SlotCommit.confirm_and_commit`, recorded as the save's outcome."""
        try:
            self.committer.confirm_and_commit(slot)
        except Exception as exc:
            self.outcomes.failed(slot.step, exc)
            if self.raise_on_error:
                raise
            return False
        self.outcomes.succeeded(slot.step, stall)
        return True

    # -- overlapped mode ----------------------------------------------------------------------

    def _enqueue(
        self, step: int, state: Any, t0: float, replicated: bool | Collection[str] | None
    ) -> None:
        enc = self._encode(state, replicated)
        slot, stream, dst = self._take_slot(step, enc)
        try:
            if slot.skip:
                slot.sigs = storage_signatures(enc.live, slot.versions, enc.sources)
            self.last_copied_nbytes = slot.copied_nbytes
            handle = copy_to_host(
                enc,
                dst,
                self.copy_pool,
                stream,
                background=self._overlap,
                skip=slot.skip,
                pinned=self.slots.is_registered(slot.lock.path),
            )
        except BaseException:
            slot.lock.release()
            raise
        self._hooks.hook(state)
        stall = time.perf_counter() - t0
        self._inflight = self._overlap.submit(self._complete, slot, handle, dst, stall)

    def _complete(
        self, slot: CopiedSlot, handle: CopyHandle, dst: torch.Tensor, stall: float
    ) -> bool:
        confirming: Future[bool] | None = None
        try:
            try:
                handle.wait()
                slot.addr = dst.data_ptr()
                del dst
                check_unchanged(slot.enc.live, slot.versions, slot.step)
                if slot.skip:  # committed by the confirmation, on the background thread (in order)
                    confirming = self._bg.submit(self._confirm, slot, stall)
                else:
                    checksum = self.committer.commit(slot)
            finally:
                if confirming is None:
                    slot.lock.release()
            if confirming is None:
                self.checksums.start(self.background, checksum)
        except Exception as exc:
            self.outcomes.failed(slot.step, exc)
            if self.raise_on_error:
                raise
            return False
        if confirming is not None:
            self.background.track(confirming)
            ok = confirming.result()  # _confirm records its own outcome
            if ok:
                self._after_save(slot.enc.data_nbytes)
            return ok
        self.outcomes.succeeded(slot.step, stall)
        self._after_save(slot.enc.data_nbytes)
        return True

    def wait_copied(self, timeout: float | None = None) -> bool | None:
        """Block until the overlapped save in flight (if any) has copied and committed.

        Returns True (committed), False (it failed: see ``last_error``) or None (nothing was in
        flight). Safe to call at any time; optimizers in an overlapped save's state call it
        before each step. Raises the save's error when ``raise_on_error``.
        """
        fut = self._inflight
        if fut is None:
            return None
        t0 = time.perf_counter()
        ok = fut.result(timeout=timeout)
        if self._inflight is fut:
            self._inflight = None
            self.overlap_wait_seconds.append(time.perf_counter() - t0)
        return ok

    # -- slots (:class:`strata.client.slot_ring.SlotRing`) ------------------------------------

    def prepare(self, nbytes: int, cuda: bool = False) -> int:
        """:meth:`SlotRing.prepare`: allocate and map the ring for states of ``nbytes`` bytes;
        the number of slots mapped. Raises what slot allocation raises."""
        return self.slots.prepare(nbytes, cuda)

    def host_view(self, data_path: Path) -> torch.Tensor | None:
        """:meth:`SlotRing.host_view` (a page-locked view of the slot that is ``data_path``)."""
        return self.slots.host_view(data_path)

    def mapping_of(self, data_path: Path) -> mmap.mmap | None:
        """:meth:`SlotRing.mapping_of` (this process's mapping of the slot ``data_path``)."""
        return self.slots.mapping_of(data_path)

    def prepare_in_background(self, nbytes: int, cuda: bool = False) -> Future[int]:
        """:meth:`prepare` on the background thread; failures are logged, never raised."""

        def run() -> int:
            try:
                return self.prepare(nbytes, cuda)
            except Exception as exc:
                log.warning("strata: preparing RAM slots of %d bytes failed: %s", nbytes, exc)
                return 0

        return self.background.submit(run)

    def _after_save(self, nbytes: int) -> None:
        # After the first save (or a larger state): map the rest of the ring off the training
        # thread, so the next save into another slot takes no first-touch page faults.
        due = self.slots.needs_prepare(nbytes)
        if due is not None:
            self.prepare_in_background(*due)

    # -- life cycle -----------------------------------------------------------------------------

    def forget_unchanged(self) -> None:
        """Start the "unchanged since" hint (and the slow components' held copies) afresh,
        after a restore wrote the live tensors."""
        self.checksums.forget()
        self.reuse.forget()
        if self.cadence is not None:
            self.cadence.forget()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the save in flight (if any, :meth:`wait_copied`) and every background
        checksum pass submitted so far have finished."""
        self.wait_copied(timeout)  # its commit may still submit work to the background thread
        self.background.wait(timeout)

    def close(self) -> None:
        """Finish an overlapped save in flight, stop the copy threads, unregister and unmap the
        slots (after :meth:`wait`; the caller owns ``background``)."""
        try:
            self.wait_copied()
        finally:
            self._hooks.remove()
            self._overlap.shutdown(wait=True)
            self.copy_pool.shutdown(wait=True)
            self.slots.close()
