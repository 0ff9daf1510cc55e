"""RAM slots registered with CUDA, and the device-to-host copy into them (issue 14).

A device-to-host copy into pageable memory runs at a third of the PCIe link (the driver bounces
it through a pinned staging buffer); into memory registered with ``cudaHostRegister`` it runs at
the link's speed, like ``pin_memory()`` (measured on an H200: 15.1 GB/s into a plain tmpfs slot
mapping, 55 GB/s after registering the same mapping; issue 14). A slot mapping is registered
once, when the state first holds CUDA tensors, and unregistered before it is unmapped.

- :class:`HostRegistry`: registers address ranges, at most ``limit_bytes`` in total (pinned
  memory is locked: it cannot be swapped or reclaimed, so it is bounded and accounted in
  ``registered_bytes``). Without CUDA, or when registration fails (limits, an old driver), it
  falls back to plain pageable copies and says so in ONE log line.
- :class:`RegisteredSlotMaps`: :class:`strata.tiers.slots.SlotMaps` that registers each mapping
  (when asked to) and unregisters it before unmapping; safe to call from a background thread
  (slots are mapped and pre-faulted off the training thread, see ``Saver.prepare``).
- :func:`copy_to_host`: enqueue the copies of a state's storages into a slot on a dedicated
  stream (non-blocking D2H; CPU storages are copied with memmove on the calling thread); returns
  a :class:`CopyHandle` whose ``wait()`` blocks until the bytes are in the slot.
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
from typing import Any

import torch

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
    """Page-locks address ranges with ``cudaHostRegister``; bounded; one log line on fallback.

    ``limit_bytes``: the most bytes registered at once (None: no bound of ours; the driver's and
    ``RLIMIT_MEMLOCK``'s still apply). ``cudart``: the CUDA runtime binding (default
    ``torch.cuda.cudart()``; a test passes a stand-in to exercise the bookkeeping without a GPU).
    """

    def __init__(self, limit_bytes: int | None = None, cudart: Any = None) -> None:
        self.limit_bytes = limit_bytes
        self._cudart = cudart
        self._ranges: dict[int, int] = {}
        self._lock = threading.Lock()
        self.fallback_reason: str | None = None
        """Why registration is off (None: on, or not tried yet); logged once."""

    @property
    def registered_bytes(self) -> int:
        """Bytes page-locked by this registry now."""
        with self._lock:
            return sum(self._ranges.values())

    def _runtime(self) -> Any:
        if self._cudart is None:
            if not torch.cuda.is_available():
                return None
            self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return self._cudart

    def _fall_back(self, why: str) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = why
            log.warning(
                "strata: RAM slots are not registered with CUDA (%s); device-to-host copies go "
                "through pageable memory at about a third of the link's speed",
                why,
            )

    def register(self, addr: int, nbytes: int) -> bool:
        """Page-lock ``[addr, addr + nbytes)``; True when it is registered (now or before)."""
        with self._lock:
            if addr in self._ranges:
                return True
            if self.fallback_reason is not None:
                return False
            rt = self._runtime()
            if rt is None:
                self._fall_back("CUDA is not available")
                return False
            used = sum(self._ranges.values())
            if self.limit_bytes is not None and used + nbytes > self.limit_bytes:
                log.warning(
                    "strata: not registering a %d-byte slot with CUDA: %d of the %d bytes allowed "
                    "are registered already (copies into it are pageable)",
                    nbytes,
                    used,
                    self.limit_bytes,
                )
                return False
            try:
                err = rt.cudaHostRegister(addr, nbytes, 0)
            except Exception as exc:  # a binding without the call: treat as unsupported
                self._fall_back(f"cudaHostRegister is unavailable: {exc}")
                return False
            code = int(getattr(err, "value", err))
            if code != 0:
                self._fall_back(f"cudaHostRegister returned error {code}")
                return False
            self._ranges[addr] = nbytes
            return True

    def unregister(self, addr: int) -> None:
        """Undo :meth:`register` of ``addr`` (a no-op when it is not registered)."""
        with self._lock:
            if self._ranges.pop(addr, None) is None:
                return
            rt = self._runtime()
            if rt is not None:
                code = int(getattr(rt.cudaHostUnregister(addr), "value", 0) or 0)
                if code != 0:
                    log.warning("strata: cudaHostUnregister returned error %d", code)

    def close(self) -> None:
        """Unregister everything still registered."""
        with self._lock:
            addrs = list(self._ranges)
        for addr in addrs:
            self.unregister(addr)


class RegisteredSlotMaps(SlotMaps):
    """Slot mappings (see :class:`SlotMaps`), registered with ``registry`` when ``register`` is
    on, unregistered before unmapping; thread-safe (a background thread may pre-map slots)."""

    def __init__(self, registry: HostRegistry) -> None:
        super().__init__()
        self.registry = registry
        self.register = False
        """Turned on by the first save whose state holds CUDA tensors."""
        self._lock = threading.RLock()
        self._addrs: dict[Path, int] = {}

    def get(self, path: Path) -> mmap.mmap:
        size = os.stat(path).st_size
        ident = path_identity(path)  # a replaced slot is remapped (issue 11)
        with self._lock:
            cur = self._maps.get(path)
            if cur is not None and cur.size == size and cur.ident == ident:
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
        if self.register and path not in self._addrs:
            addr = _address(mm)
            if self.registry.register(addr, len(mm)):
                self._addrs[path] = addr

    def _close(self, path: Path) -> None:
        with self._lock:
            addr = self._addrs.pop(path, None)
            if addr is not None:
                self.registry.unregister(addr)
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

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._wait()
            self._done = True


def holds_cuda(enc: codec.EncodedState) -> bool:
    """Whether any storage of the encoded state lives on a CUDA device."""
    if enc.layout is not None:
        return enc.layout.cuda
    return any(src.device.type == "cuda" for src in enc.sources)


def copy_to_host(
    enc: codec.EncodedState,
    dst: torch.Tensor,
    pool: Executor | None,
    stream: Any = None,
    *,
    background: Executor | None = None,
    skip: frozenset[int] = frozenset(),
) -> CopyHandle:
    """Enqueue the copy of every storage of ``enc`` into ``dst`` (1-D uint8 CPU, the slot),
    except the storages in ``skip`` (indices whose bytes the slot already holds,
    :mod:`strata.client.reuse`).

    CUDA storages: ``copy_(non_blocking=True)`` on ``stream`` (a dedicated side stream that first
    waits for the current stream, so it copies what the training computed); the handle waits on
    an event recorded after the last copy. All-CPU states: :func:`codec.write_data` on the copy
    threads, run on ``background`` when given (the handle then waits for it), else now.
    """
    if not holds_cuda(enc):
        if background is None:
            codec.write_data(enc, dst, pool=pool, skip=skip)
            return CopyHandle(lambda: None)
        fut = background.submit(codec.write_data, enc, dst, pool, skip)
        return CopyHandle(lambda: fut.result())
    device = next(src.device for src in enc.sources if src.device.type == "cuda")
    if stream is None:
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    end = 0
    with torch.cuda.stream(stream):
        for i, (entry, src) in enumerate(zip(enc.storages, enc.sources, strict=True)):
            if entry.offset > end:
                dst[end : entry.offset].zero_()
            if entry.nbytes and i not in skip:
                dst[entry.offset : entry.offset + entry.nbytes].copy_(
                    src, non_blocking=src.device.type == "cuda"
                )
            end = entry.offset + entry.nbytes
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    return CopyHandle(event.synchronize)
