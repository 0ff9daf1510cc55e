"""RAM slots registered with CUDA, and the device-to-host copy into them.

A device-to-host copy into pageable memory runs at a third of the PCIe link (the driver bounces
it through a pinned staging buffer); into memory registered with ``cudaHostRegister`` it runs at
the link's speed, like ``pin_memory()`` (measured on an H200: 15.1 GB/s into a plain tmpfs slot
mapping, 55 GB/s after registering the same mapping). A slot mapping is registered
once, when the state first holds CUDA tensors, and unregistered before it is unmapped.

- :class:`HostRegistry`: registers address ranges, at most ``limit_bytes`` in total (pinned
  memory is locked: it cannot be swapped or reclaimed, so it is bounded and accounted in
  ``registered_bytes``). Without CUDA, or when registration fails (limits, an old driver), it
  falls back to plain pageable copies and says so in ONE log line.
- :class:`RegisteredSlotMaps`: :class:`strata.tiers.slots.SlotMaps` that registers each mapping
  (when asked to) and unregisters it before unmapping; safe to call from a background thread
  (slots are mapped and pre-faulted off the training thread, see ``Saver.prepare``).
- :func:`copy_to_host`: enqueue the copies of a state's storages into a slot, one side stream
  and one completion event per device holding some of them (non-blocking D2H); the CPU
  storages of a mixed state go to the copy threads meanwhile; returns a :class:`CopyHandle`
  whose ``wait()`` blocks until every device's bytes are in the slot.

Every CUDA call goes through the device seam (:mod:`strata.client.device`), so all of this runs
under its CPU stand-in in the tests. Registration is portable (``cudaHostRegisterPortable``)
and made with the state's device current (no context on device 0 for every rank of a node);
it runs outside the locks a save takes (a save into one slot never waits for a registration of
another, nor for one of its own slot: it then copies pageable); a failed registration leaves no
CUDA error pending, is logged once per error code and disables registration for that mapping
only (CUDA being unavailable disables it for the registry).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import torch

from strata.client import device as devices
from strata.client.device import CudaDevice, Device, Event, HostRegisterError, Stream
from strata.format import codec
from strata.tiers.slots import SlotMaps, path_identity

log = logging.getLogger("strata.client")


def _address(mm: mmap.mmap) -> int:
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


class HostRegistry:
    """Page-locks address ranges (``cudaHostRegister``, portable); bounded; one log line per
    kind of failure.

    ``limit_bytes``: the most bytes registered at once (None: no bound of ours; the driver's and
    ``RLIMIT_MEMLOCK``'s still apply). ``device``: the device seam (default
    :func:`strata.client.device.active` at construction).
    """

    def __init__(self, limit_bytes: int | None = None, device: Device | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.device = device if device is not None else devices.active()
        self._ranges: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        self._lock = threading.Lock()
        self._logged: set[int] = set()
        self.fallback_reason: str | None = None
        """Why registration is off for good (None: on, or not tried yet); logged once."""
        self.failures = 0
        """Registrations refused by the driver (each leaves that range pageable)."""

    @property
    def registered_bytes(self) -> int:
        """Bytes page-locked by this registry now."""
        with self._lock:
            return sum(self._ranges.values())

    def _fall_back(self, why: str) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = why
            log.warning(
                "strata: RAM slots are not registered with CUDA (%s); device-to-host copies go "
                "through pageable memory at about a third of the link's speed",
                why,
            )

    def register(self, addr: int, nbytes: int, index: int | None = None) -> bool:
        """Page-lock ``[addr, addr + nbytes)`` with device ``index`` current (None: the calling
        thread's current device); True when it is registered (now or before). The driver call
        runs outside this registry's lock (registering GBs takes a second or more)."""
        with self._lock:
            if addr in self._ranges:
                return True
            if self.fallback_reason is not None or addr in self._pending:
                return False
            if not self.device.available():
                self._fall_back("CUDA is not available")
                return False
            used = sum(self._ranges.values()) + sum(self._pending.values())
            if self.limit_bytes is not None and used + nbytes > self.limit_bytes:
                log.warning(
                    "strata: not registering a %d-byte slot with CUDA: %d of the %d bytes allowed "
                    "are registered already (copies into it are pageable)",
                    nbytes,
                    used,
                    self.limit_bytes,
                )
                return False
            self._pending[addr] = nbytes
        ok = False
        try:
            at = index if index is not None else self.device.current_device()
            self.device.register_host(addr, nbytes, at)
            ok = True
        except HostRegisterError as exc:
            self._refused(exc)
        finally:
            with self._lock:
                self._pending.pop(addr, None)
                if ok:
                    self._ranges[addr] = nbytes
        return ok

    def _refused(self, exc: HostRegisterError) -> None:
        if exc.code == 0:  # no such call in this runtime: nothing will ever register
            self._fall_back(str(exc))
            return
        with self._lock:
            self.failures += 1
            first = exc.code not in self._logged
            self._logged.add(exc.code)
        if first:
            log.warning(
                "strata: a RAM slot could not be registered with CUDA (%s); copies into that "
                "slot go through pageable memory, other slots still try (raise RLIMIT_MEMLOCK or "
                "set register_limit_bytes to stay within it)",
                exc,
            )

    def unregister(self, addr: int) -> None:
        """Undo :meth:`register` of ``addr`` (a no-op when it is not registered)."""
        with self._lock:
            if self._ranges.pop(addr, None) is None:
                return
        try:
            self.device.unregister_host(addr)
        except HostRegisterError as exc:
            log.warning("strata: %s", exc)

    def close(self) -> None:
        """Unregister everything still registered."""
        with self._lock:
            addrs = list(self._ranges)
        for addr in addrs:
            self.unregister(addr)


class RegisteredSlotMaps(SlotMaps):
    """Slot mappings (see :class:`SlotMaps`), registered with ``registry`` when ``register`` is
    on, unregistered before unmapping; thread-safe (a background thread may pre-map slots).
    Registration runs outside the lock (a save's ``get`` of a slot never waits for it); a
    mapping is not unmapped while its registration is in flight."""

    def __init__(self, registry: HostRegistry) -> None:
        super().__init__()
        self.registry = registry
        self.register = False
        """Turned on by the first save whose state holds CUDA tensors."""
        self.device_index: int | None = None
        """The device current while registering (the state's first device; None: the
        registering thread's current device, remembered from then on)."""
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._addrs: dict[Path, int] = {}
        self._registering: set[Path] = set()
        self._refused: dict[Path, int] = {}  # path -> address of the mapping refused

    def get(self, path: Path) -> mmap.mmap:
        size = os.stat(path).st_size
        ident = path_identity(path)  # a replaced slot is remapped
        with self._lock:
            cur = self._maps.get(path)
            hit = cur is not None and cur.size == size and cur.ident == ident
        if hit:
            assert cur is not None
            self._register(path, cur.mm)
            return cur.mm
        # Map (and pre-fault) outside the lock: a background pre-map of one slot must not hold
        # up a save into another. The mapping keeps its mapping lease (strata.tiers.slots).
        entry = self._map(path)
        with self._lock:
            cur = self._maps.get(path)
            if cur is not None and cur.size == entry.size and cur.ident == entry.ident:
                self._release(entry)
                mm = cur.mm
            else:
                if cur is not None:
                    self._close(path)
                self._maps[path] = entry
                mm = entry.mm
        self._register(path, mm)
        return mm

    def _register(self, path: Path, mm: mmap.mmap) -> None:
        if not self.register:
            return
        with self._lock:
            cur = self._maps.get(path)
            if path in self._addrs or path in self._registering or cur is None or cur.mm is not mm:
                return
            addr = _address(mm)
            if self._refused.get(path) == addr:
                return
            if self.device_index is None:
                self.device_index = self.registry.device.current_device()
            index = self.device_index
            self._registering.add(path)
        ok = False
        try:
            ok = self.registry.register(addr, len(mm), index)
        finally:
            with self._lock:
                self._registering.discard(path)
                if ok:
                    self._addrs[path] = addr
                else:
                    self._refused[path] = addr
                self._idle.notify_all()

    def _close(self, path: Path) -> None:
        with self._lock:
            self._idle.wait_for(lambda: path not in self._registering)
            addr = self._addrs.pop(path, None)
            if addr is not None:
                self.registry.unregister(addr)
            self._refused.pop(path, None)
            super()._close(path)

    def close(self) -> None:
        with self._lock:
            super().close()

    def mapped(self) -> list[Path]:
        """The slot files mapped now."""
        with self._lock:
            return list(self._maps)

    def is_registered(self, path: Path) -> bool:
        with self._lock:
            return path in self._addrs


class CopyHandle:
    """Copies of one save in flight; :meth:`wait` returns when every byte is in the slot."""

    def __init__(self, wait: Callable[[], None], synchronous: bool = False) -> None:
        self._wait = wait
        self._done = False
        self.synchronous = synchronous
        """Whether the device copies ran synchronously (into pageable memory) when enqueued."""

    def wait(self) -> None:
        if not self._done:
            self._wait()
            self._done = True


def device_storages(enc: codec.EncodedState, device: Device | None = None) -> dict[int, list[int]]:
    """Per device index, the indices of ``enc``'s storages on that device (empty: all CPU)."""
    dev = device if device is not None else devices.active()
    if isinstance(dev, CudaDevice) and enc.layout is not None and not enc.layout.cuda:
        return {}
    out: dict[int, list[int]] = {}
    for i, src in enumerate(enc.sources):
        index = dev.index_of(src)
        if index is not None:
            out.setdefault(index, []).append(i)
    return out


def holds_cuda(enc: codec.EncodedState, device: Device | None = None) -> bool:
    """Whether any storage of the encoded state lives on a CUDA device."""
    dev = device if device is not None else devices.active()
    if isinstance(dev, CudaDevice) and enc.layout is not None:
        return enc.layout.cuda
    return any(dev.index_of(src) is not None for src in enc.sources)


def side_streams(
    enc: codec.EncodedState, maps: RegisteredSlotMaps, streams: dict[int, Stream]
) -> dict[int, Stream] | None:
    """The saver's side streams for ``enc`` (None: no device storage): one per device holding
    some, created on first use into ``streams`` (kept across saves). Turns registration of
    ``maps`` on, with the state's first device current while registering."""
    groups = device_storages(enc, maps.registry.device)
    if not groups:
        return None
    maps.register = True
    if maps.device_index is None:
        maps.device_index = min(groups)
    dev = maps.registry.device
    for index in groups:
        if index not in streams:
            streams[index] = dev.stream(index)
    return streams


_warned_sync = False


def copy_to_host(
    enc: codec.EncodedState,
    dst: torch.Tensor,
    pool: Executor | None,
    streams: dict[int, Stream] | None = None,
    *,
    background: Executor | None = None,
    skip: frozenset[int] = frozenset(),
    pinned: bool = True,
    device: Device | None = None,
) -> CopyHandle:
    """Enqueue the copy of every storage of ``enc`` into ``dst`` (1-D uint8 CPU, the slot),
    except the storages in ``skip`` (indices whose bytes the slot already holds,
    :mod:`strata.client.reuse`).

    Device storages: for each device, on its side stream (``streams[index]``, created when
    missing), which first waits for the device's current stream (so it copies what the training
    computed), then records an event; the handle waits for every device's event. ``pinned``:
    whether ``dst`` is registered (False with ``background``: the device copies are synchronous,
    an overlapped save blocks for them, logged once). CPU storages and the padding:
    :func:`codec.write_data` on the copy threads, on ``background`` when given (the handle then
    waits for it too), else now, while the device copies run.
    """
    global _warned_sync
    dev = device if device is not None else devices.active()
    groups = device_storages(enc, dev)
    on_device = frozenset(i for idx in groups.values() for i in idx)
    events: list[Event] = []
    if groups and background is not None and not pinned and not _warned_sync:
        _warned_sync = True
        log.warning(
            "strata: an overlapped save (blocking=False) copies device tensors into a RAM slot "
            "that is not registered with CUDA: those copies are synchronous, so save() blocks "
            "for them (see the log line on registration)"
        )
    for index in sorted(groups):
        if streams is None:
            streams = {}
        if index not in streams:
            streams[index] = dev.stream(index)
        stream = streams[index]
        stream.wait_stream(dev.current_stream(index))
        for i in groups[index]:
            entry = enc.storages[i]
            if entry.nbytes and i not in skip:
                dev.copy(dst[entry.offset : entry.offset + entry.nbytes], enc.sources[i], stream)
        event = dev.event(index)
        event.record(stream)
        events.append(event)
    cpu_skip = skip | on_device

    def wait_devices() -> None:
        for event in events:
            event.synchronize()

    sync = bool(groups) and not pinned
    if background is None:
        codec.write_data(enc, dst, pool=pool, skip=cpu_skip)
        return CopyHandle(wait_devices, sync)
    fut = background.submit(codec.write_data, enc, dst, pool, cpu_skip)

    def wait_all() -> None:
        fut.result()
        wait_devices()

    return CopyHandle(wait_all, sync)
