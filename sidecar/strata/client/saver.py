"""The save path of the training client: :class:`Saver` (one rank's saves into the RAM tier).

``save(step, state)`` encodes the state (:mod:`strata.format.codec`), takes a free slot of the
RAM ring (:mod:`strata.tiers.slots`), copies every tensor storage into it (several threads),
commits the step in the RAM tier with a manifest *without* checksums, and returns: the stall is
the copy. A background thread then checksums the slot and atomically rewrites the manifest with
its CRC32Cs (:meth:`strata.tiers.ram.RamTier.seal`) and the per-storage "unchanged since" hint
(:mod:`strata.client.unchanged`, issue 18); promotion only takes checksummed shards.
The failure policy is :class:`strata.client.checkpointer.Checkpointer`'s (its module docstring).

Overlapped mode, ``save(step, state, blocking=False)`` (issue 14): encodes the state, takes a
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

Storages left in place (issue 18, :mod:`strata.client.reuse`): a blocking save into a slot
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
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from strata import faults
from strata.client.cadence import ComponentCadence
from strata.client.cuda_host import (
    CopyHandle,
    HostRegistry,
    RegisteredSlotMaps,
    copy_to_host,
    side_streams,
)
from strata.client.reuse import SlotReuse
from strata.client.unchanged import Signature, Snapshot, UnchangedTracker, storage_signatures
from strata.config import Interval
from strata.errors import ShardUnavailable, StateChanged, TierError
from strata.format import codec, layout
from strata.format.encode_cache import EncodeCache
from strata.format.manifest import DEFAULT_CHUNK_SIZE, Manifest, StorageEntry
from strata.intervals import due_now, interval_policy
from strata.protocol import ClientEvent, SaveEvent
from strata.tiers.ram import RamTier
from strata.tiers.slots import (
    Identity,
    SlotLease,
    SlotProvider,
    SlotWriteLock,
    path_identity,
    slots_dir,
)

log = logging.getLogger("strata.client")


class Saver:
    """Saves of one rank (``job_id``, ``rank`` of ``world_size``) into the RAM tier ``ram``.

    ``slot_provider``: where slots come from (in process, or the sidecar). ``every``: the RAM
    tier's interval (:meth:`should_save`). ``writer_id``: stamped into every manifest.
    ``background``: the single thread running checksum passes (and the client's reports, so
    that a report never overtakes the checksum of its step). ``report``: receives one
    :class:`strata.protocol.SaveEvent` per save. ``copy_threads``: threads copying into a slot.
    ``raise_on_error``: raise every save failure instead of returning False.
    ``register_limit_bytes``: the most slot bytes page-locked with CUDA at once (None: the
    driver's limits only); see :mod:`strata.client.cuda_host`.
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
        self.incarnation = ""
        """Stamped into every manifest: the incarnation :meth:`Checkpointer.restore` opened
        (``""`` before any restore: shards of no incarnation)."""
        self.every = every
        self._bg = background
        self.report = report
        self.raise_on_error = raise_on_error
        self.chunk_size = DEFAULT_CHUNK_SIZE
        self.host = HostRegistry(register_limit_bytes)
        self._maps = RegisteredSlotMaps(self.host)
        self._overlap = ThreadPoolExecutor(1, thread_name_prefix="strata-overlap")
        self._inflight: Future[bool] | None = None
        self._streams: dict[Any, Any] = {}
        self._hooked: dict[int, Any] = {}
        self._prepared: tuple[int, bool] | None = None
        self._enc_cache = EncodeCache()
        self.copy_threads = max(1, copy_threads)
        self.copy_pool = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="strata-copy")
        """The copy threads (saves; restores use them too: training waits for both)."""
        self._pending: list[Future[None]] = []
        self._pending_lock = threading.Lock()
        self._last_save_time: float | None = None
        self.last_error: str | None = None
        """The newest failure of a save or of a background checksum pass (None: none yet)."""
        self.failed_saves = 0
        self.saves = 0
        self.last_stall_seconds: float | None = None
        self.stall_seconds: list[float] = []
        """The stall of every successful save, seconds, in order."""
        self.last_saved_step: int | None = None
        self._unchanged = UnchangedTracker()
        self.reuse = SlotReuse(ram, job_id, rank)
        """What each slot holds (:mod:`strata.client.reuse`); ``reuse.enabled = False`` copies
        every storage on every save."""
        self.last_copied_nbytes: int | None = None
        """Bytes the newest save wrote into its RAM slot (storages left in place are not
        written: :mod:`strata.client.reuse`)."""
        self.cadence: ComponentCadence | None = None
        """Slow components (:mod:`strata.client.cadence`); set by the checkpointer."""
        self._component_steps: dict[int, dict[str, int]] = {}
        self.overlap_wait_seconds: list[float] = []
        """Per :meth:`wait_copied` that found a copy in flight, how long it blocked, seconds."""

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a RAM checkpoint (``ram.every``: steps and/or seconds)."""
        return due_now(interval_policy(self.every), step, time.monotonic(), self._last_save_time)

    def save(
        self,
        step: int,
        state: Any,
        blocking: bool = True,
        replicated: bool | Collection[str] | None = None,
    ) -> bool:
        """Snapshot ``state`` as ``step`` into the RAM tier.

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
                    self._component_steps[step] = slow
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
            self._failed(step, exc)
            if self.raise_on_error:
                raise
            return False
        try:
            stall = time.perf_counter() - t0
            if checksum is not None:
                # Started only now: the background pass holds the GIL for a while (per-tensor
                # Python), which would otherwise slow the end of this save down (bench W3).
                # Before the report, which must never overtake its step's checksum.
                self._start_checksum(checksum)
            if not deferred:
                self._succeeded(step, stall)
            else:
                self.last_stall_seconds = stall
            if blocking:
                self._after_save(nbytes)
        finally:
            if collect:
                gc.enable()
        return True

    def _failed(self, step: int, exc: BaseException) -> None:
        self.failed_saves += 1
        self.last_error = f"save of step {step} failed: {exc}"
        log.error(
            "strata: save of step %d failed (training continues; the previous committed "
            "step is intact): %s",
            step,
            exc,
        )
        self.report(
            SaveEvent(job_id=self.job_id, rank=self.rank, step=step, ok=False, error=str(exc))
        )

    def _succeeded(self, step: int, stall: float) -> None:
        self.report(
            SaveEvent(job_id=self.job_id, rank=self.rank, step=step, ok=True, stall_seconds=stall)
        )
        self.last_stall_seconds = stall
        self.stall_seconds.append(stall)
        self.saves += 1
        self.last_saved_step = step
        self._last_save_time = time.monotonic()

    def _stream(self, enc: codec.EncodedState) -> Any:
        return side_streams(enc, self._maps, self._streams)  # one per device (cuda_host)

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
    ) -> tuple[int, bool, _Checksum | None]:
        """Copy and commit (or, with storages left in place, copy and hand the commit to the
        background confirmation: then True); returns (data bytes, deferred, the checksum pass
        to start: :meth:`_start_checksum`)."""
        enc = self._encode(state, replicated)
        stream = self._stream(enc)
        valid = self.reuse.validate()
        lock = SlotWriteLock.acquire(self.slot_provider, self.job_id, self.rank, enc.data_nbytes)
        deferred = False
        checksum = None
        try:
            rec = self.reuse.take(lock.identity, valid)  # before anything writes into the slot
            versions = _versions(enc.live)
            # CUDA states are always copied in full: confirming needs their bytes on the host
            skip = self.reuse.plan(rec, enc, versions) if stream is None else frozenset()
            mm = self._mapping(lock)
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            try:
                copy_to_host(enc, dst, self.copy_pool, stream, skip=skip).wait()
                addr = dst.data_ptr()
            finally:
                del dst
            self.last_copied_nbytes = enc.data_nbytes - sum(enc.storages[i].nbytes for i in skip)
            if skip:
                sigs = storage_signatures(enc.live, versions, enc.sources)  # as copied
                stall = time.perf_counter() - t0
                fut = self._bg.submit(
                    self._confirm, step, enc, lock, versions, skip, addr, stall, sigs
                )
                self._inflight = fut
                with self._pending_lock:
                    self._pending = [f for f in self._pending if not f.done()] + [fut]  # type: ignore[list-item]
                deferred = True
            else:
                checksum = self._commit(step, enc, lock, versions)
        finally:
            if not deferred:
                lock.release()
        return enc.data_nbytes, deferred, checksum

    def _mapping(self, lock: SlotWriteLock) -> Any:
        """The mapping of exactly the inode ``lock`` holds (issue 11: the trainer never writes
        through a mapping of a file that is no longer the slot). Raises TierError."""
        mm = self._maps.get(lock.path)
        if self._maps.identity(lock.path) != lock.identity:
            self._maps.forget(lock.path)
            mm = self._maps.get(lock.path)
            if self._maps.identity(lock.path) != lock.identity:
                raise TierError(
                    f"RAM slot {lock.path} was replaced while locked; this save is skipped"
                )
        return mm

    def _commit(
        self, step: int, enc: codec.EncodedState, lock: SlotWriteLock, versions: list[int]
    ) -> _Checksum:
        """Commit the copied slot ``lock`` holds (checked to be the inode written, issue 11);
        ``versions``: the version counters of ``enc.live`` as of the bytes copied (the
        "unchanged since" hint, :mod:`strata.client.unchanged`). Returns the checksum pass for
        the caller to start (:meth:`_start_checksum`)."""
        faults.point("save.copied")
        manifest = self._manifest(step, enc)
        self.ram.commit_slot(
            self.job_id, step, self.rank, lock.path, manifest, expect=lock.identity
        )
        snap = Snapshot(list(enc.live), versions, list(enc.sources))
        return (step, manifest.created.isoformat(), snap, lock.identity, enc.storages)

    def _start_checksum(self, checksum: _Checksum) -> None:
        """Submit a committed step's background checksum pass (see :meth:`wait`); never raises
        (the step then stays committed without checksums, as when its writer dies)."""
        try:
            fut = self._bg.submit(self._checksum, *checksum)
        except RuntimeError as exc:  # the background executor was shut down
            self.last_error = f"checksum of step {checksum[0]} not started: {exc}"
            log.error("strata: checksum pass of step %d not started: %s", checksum[0], exc)
            return
        with self._pending_lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]

    def _manifest(self, step: int, enc: codec.EncodedState) -> Manifest:
        manifest = enc.manifest(
            job_id=self.job_id,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            writer_id=self.writer_id,
            chunk_size=self.chunk_size,
        ).model_copy(update={"incarnation": self.incarnation})
        slow = self._component_steps.pop(step, None)
        if slow:
            manifest = manifest.model_copy(update={"component_steps": slow})
        return manifest

    def _confirm(
        self,
        step: int,
        enc: codec.EncodedState,
        lock: SlotWriteLock,
        versions: list[int],
        skip: frozenset[int],
        addr: int,
        stall: float,
        sigs: list[Signature | None] | None = None,
    ) -> bool:
        """Background: commit a save that left ``skip`` in place once the slot's bytes are
        confirmed to be the live ones (:func:`strata.client.reuse.confirm`); releases ``lock``.
        A mismatch makes the step a failed save and turns skipping off for those storages.
        ``sigs``: as read by ``save()`` (read here, a storage reallocated since looked unmoved)."""
        try:
            try:
                if sigs is None:
                    sigs = storage_signatures(enc.live, versions, enc.sources)
                snap = Snapshot(list(enc.live), versions, list(enc.sources))
                unchanged = self._unchanged.since(step, snap, sigs)
                faults.point("save.confirm")
                res = self.reuse.confirmed(
                    step, enc, addr, skip, sigs, self.chunk_size, self.copy_pool, self.copy_threads
                )
                manifest = self._manifest(step, enc).model_copy(
                    update={
                        "chunk_crc32c": res.chunk_crc32c,
                        "crc32c": res.crc32c,
                        "unchanged_since": unchanged,
                    }
                )
                self.ram.commit_slot(
                    self.job_id, step, self.rank, lock.path, manifest, expect=lock.identity
                )
                self.reuse.remember(lock.identity, step, enc.storages, sigs, enc.sources)
            finally:
                lock.release()
        except Exception as exc:
            self._failed(step, exc)
            if self.raise_on_error:
                raise
            return False
        self._succeeded(step, stall)
        return True

    # -- overlapped mode ----------------------------------------------------------------------

    def _enqueue(
        self, step: int, state: Any, t0: float, replicated: bool | Collection[str] | None
    ) -> None:
        enc = self._encode(state, replicated)
        versions = _versions(enc.live)
        stream = self._stream(enc)
        valid = self.reuse.validate()
        lock = SlotWriteLock.acquire(self.slot_provider, self.job_id, self.rank, enc.data_nbytes)
        try:
            rec = self.reuse.take(lock.identity, valid)  # before anything writes into the slot
            skip = self.reuse.plan(rec, enc, versions) if stream is None else frozenset()
            sigs = storage_signatures(enc.live, versions, enc.sources) if skip else None
            self.last_copied_nbytes = enc.data_nbytes - sum(enc.storages[i].nbytes for i in skip)
            mm = self._mapping(lock)
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            handle = copy_to_host(
                enc,
                dst,
                self.copy_pool,
                stream,
                background=self._overlap,
                skip=skip,
                pinned=self._maps.is_registered(lock.path),
            )
        except BaseException:
            lock.release()
            raise
        self._hook_optimizers(state)
        stall = time.perf_counter() - t0
        self._inflight = self._overlap.submit(
            self._complete, step, enc, versions, lock, handle, dst, stall, skip, sigs
        )

    def _complete(
        self,
        step: int,
        enc: codec.EncodedState,
        versions: list[int],
        lock: SlotWriteLock,
        handle: CopyHandle,
        dst: torch.Tensor,
        stall: float,
        skip: frozenset[int] = frozenset(),
        sigs: list[Signature | None] | None = None,
    ) -> bool:
        confirming: Future[bool] | None = None
        try:
            try:
                handle.wait()
                addr = dst.data_ptr()
                del dst
                now = _versions(enc.live)
                changed = [
                    i
                    for i, (n, v) in enumerate(zip(now, versions, strict=True))
                    if v >= 0 and n != v
                ]
                if changed:
                    raise StateChanged(
                        f"{len(changed)} tensor(s) of the state changed in place while an "
                        f"overlapped save of step {step} was copying them, so that step is not "
                        "committed; call wait_copied() (or let optimizer.step() do it) before "
                        "changing the state"
                    )
                if skip:  # committed by the confirmation, on the background thread (in order)
                    confirming = self._bg.submit(
                        self._confirm, step, enc, lock, versions, skip, addr, stall, sigs
                    )
                else:
                    checksum = self._commit(step, enc, lock, versions)
            finally:
                if confirming is None:
                    lock.release()
            if confirming is None:
                self._start_checksum(checksum)
        except Exception as exc:
            self._failed(step, exc)
            if self.raise_on_error:
                raise
            return False
        if confirming is not None:
            with self._pending_lock:
                self._pending = [f for f in self._pending if not f.done()] + [confirming]  # type: ignore[list-item]
            ok = confirming.result()  # _confirm records its own outcome
            if ok:
                self._after_save(enc.data_nbytes)
            return ok
        self._succeeded(step, stall)
        self._after_save(enc.data_nbytes)
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

    def _hook_optimizers(self, state: Any) -> None:
        for opt in _optimizers(state):
            if id(opt) not in self._hooked:
                self._hooked[id(opt)] = opt.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, *_args: Any, **_kw: Any) -> None:
        self.wait_copied()

    # -- slots before the first save ----------------------------------------------------------

    def prepare(self, nbytes: int, cuda: bool = False) -> int:
        """Allocate the slot ring for states of ``nbytes`` bytes and map (pre-fault) every slot
        that holds them, registering them with CUDA when ``cuda``; the number of slots mapped.

        Taking a slot may un-commit the oldest RAM step beyond ``ram.keep``, as the next save
        would. Raises what slot allocation raises (:class:`strata.errors.TierFull`, ...).
        """
        if nbytes <= 0:
            return 0
        if cuda:
            self._maps.register = True
        if len(self._slots_for(nbytes)) < self.ram.keep + 1:
            # The provider allocates the whole ring on first use. Only then: taking a slot
            # lock here while a save looks for one would make that save skip the slot.
            with SlotWriteLock.acquire(self.slot_provider, self.job_id, self.rank, nbytes):
                pass
        mapped = 0
        for path in self._slots_for(nbytes):
            self._maps.get(path)
            mapped += 1
        self._prepared = (nbytes, cuda)
        return mapped

    def _slots_for(self, nbytes: int) -> list[Path]:
        try:
            entries = list(os.scandir(slots_dir(self.ram.root, self.job_id, self.rank)))
        except FileNotFoundError:
            return []
        return sorted(
            Path(e.path)
            for e in entries
            if layout.parse_slot(e.name) is not None and e.stat().st_size >= nbytes
        )

    def host_view(self, data_path: Path) -> torch.Tensor | None:
        """A 1-D uint8 CPU tensor over this rank's RAM slot that is ``data_path`` (a committed
        shard's data file: the same inode), mapped and registered with CUDA, so that a restore
        copies host-to-device from page-locked memory; the registration stays for the next
        saves into that slot. None when ``data_path`` is no slot of this rank or registration
        is unavailable (see :mod:`strata.client.cuda_host`)."""
        ino = os.stat(data_path).st_ino
        for slot in self._slots_for(0):
            if os.stat(slot).st_ino == ino:
                self._maps.register = True
                mm = self._maps.get(slot)
                if not self._maps.is_registered(slot):
                    return None
                return torch.frombuffer(mm, dtype=torch.uint8)
        return None

    def mapping_of(self, data_path: Path) -> mmap.mmap | None:
        """This process's populated mapping of the RAM slot that is ``data_path`` (the same
        inode), if it already maps one (never maps here): a restore reads it without a page
        fault. None otherwise."""
        return self._maps.mapping_of(path_identity(data_path))

    def prepare_in_background(self, nbytes: int, cuda: bool = False) -> Future[int]:
        """:meth:`prepare` on the background thread; failures are logged, never raised."""

        def run() -> int:
            try:
                return self.prepare(nbytes, cuda)
            except Exception as exc:
                log.warning("strata: preparing RAM slots of %d bytes failed: %s", nbytes, exc)
                return 0

        fut = self._bg.submit(run)
        with self._pending_lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]  # type: ignore[list-item]
        return fut

    def _after_save(self, nbytes: int) -> None:
        # After the first save (or a larger state): map the rest of the ring off the training
        # thread, so the next save into another slot takes no first-touch page faults.
        cuda = self._maps.register
        if self._prepared is None or self._prepared[0] < nbytes or self._prepared[1] != cuda:
            self._prepared = (nbytes, cuda)
            self.prepare_in_background(nbytes, cuda)

    def _checksum(
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
            unchanged = self._unchanged.since(step, snap, sigs)
            with SlotLease(self.ram, self.job_id, step, self.rank) as lease:
                m = lease.manifest
                if m is None or m.verified or m.created.isoformat() != created:
                    return
                if self.ram.seal(lease, unchanged) is not None:
                    self.reuse.remember(slot, step, storages, sigs, snap.sources)
        except ShardUnavailable as exc:
            log.info("strata: step %d left the RAM tier before its checksum pass: %s", step, exc)
        except Exception as exc:
            self.last_error = f"checksum of step {step} failed: {exc}"
            log.error("strata: checksum pass of step %d failed: %s", step, exc)

    def forget_unchanged(self) -> None:
        """Start the "unchanged since" hint (and the slow components' held copies) afresh,
        after a restore wrote the live tensors."""
        self._unchanged = UnchangedTracker()
        self.reuse.forget()
        if self.cadence is not None:
            self.cadence.forget()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the save in flight (if any, :meth:`wait_copied`) and every background
        checksum pass submitted so far have finished."""
        self.wait_copied(timeout)  # its commit may still submit work to the background thread
        with self._pending_lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result(timeout=timeout)

    def close(self) -> None:
        """Finish an overlapped save in flight, stop the copy threads, unregister and unmap the
        slots (after :meth:`wait`; the caller owns ``background``)."""
        try:
            self.wait_copied()
        finally:
            for handle in self._hooked.values():
                handle.remove()
            self._hooked.clear()
            self._overlap.shutdown(wait=True)
            self.copy_pool.shutdown(wait=True)
            self._maps.close()
            self.host.close()


_Checksum = tuple[int, str, Snapshot, Identity, list[StorageEntry]]
"""The arguments of :meth:`Saver._checksum`: a committed step's checksum pass to start."""


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference-mode tensors have no version counter
        return -1


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """``_version`` of each tensor (-1 where it has none): one comprehension, the per-tensor
    function call only when some tensor has no counter (bench W3: 10,000 tensors)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference-mode tensor
        return [_version(t) for t in tensors]


def _optimizers(state: Any, depth: int = 0) -> list[torch.optim.Optimizer]:
    """Optimizers in the state tree (dicts, lists, tuples; a few levels deep)."""
    if isinstance(state, torch.optim.Optimizer):
        return [state]
    if depth > 3 or isinstance(state, torch.Tensor):
        return []
    if isinstance(state, dict):
        values: Any = state.values()
    elif isinstance(state, (list, tuple)):
        values = state
    else:
        return []
    return [o for v in values for o in _optimizers(v, depth + 1)]
