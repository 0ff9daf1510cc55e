"""The device seam: every CUDA operation the client uses, behind one small interface.

Strata's client touches CUDA in few places: page-locking RAM slot mappings
(``cudaHostRegister``), side streams and events, asynchronous device-to-host and host-to-device
copies, the current device. They all go through a :class:`Device`:

- :class:`CudaDevice` (the default, :func:`active`): the real thing, through torch and the CUDA
  runtime torch loaded;
- :class:`StandInDevice`: a CPU stand-in with the same asynchrony, so that every CUDA branch of
  save, overlapped save, restore and resharding runs in CI without a GPU. Its "device tensors"
  are CPU tensors it allocated (:meth:`StandInDevice.tensor`); a copy enqueued on a stream lands
  later, on that stream's worker thread (after ``latency_s``, or, with ``hold``, only when some
  wait needs it: a missing wait leaves the slot torn, deterministically); events complete when
  the copies before them do; ``wait_stream`` orders streams; registration fails on demand
  (``register_error``); several devices (``devices``).

Call order of a copy (both implementations): ``side = dev.stream(k)``;
``side.wait_stream(dev.current_stream(k))`` (copy what the training computed);
``dev.copy(dst, src, side)`` for each tensor of device ``k``; ``ev = dev.event(k)``;
``ev.record(side)``; later ``ev.synchronize()`` before the bytes are used. A copy must be
enqueued on a stream of the device that holds its device tensor: PyTorch runs a copy on the
*device tensor's* current stream when the given stream is another device's, unordered with
that stream's events (so a step could be committed before those bytes land); the stand-in
raises :class:`DeviceError` for it, the CUDA implementation switches to the right device.

A copy between device memory and host memory that is not page-locked is synchronous in CUDA
(the driver stages it through its own pinned buffer): the stand-in does the same, so an
overlapped save into an unregistered slot blocks under both.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from strata.errors import StrataError

log = logging.getLogger("strata.client")

HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the range is page-locked for every CUDA context, not only the
current device's (CUDA runtime API, ``cudaHostRegister``). Without it a slot registered while
device 0 was current is pinned for device 0 only: copies from other devices through it are
pageable (synchronous, a third of the link)."""


class DeviceError(StrataError):
    """A device operation failed or was used against the seam's contract (the message says
    which and what to do)."""


class HostRegisterError(DeviceError):
    """``cudaHostRegister`` refused a range; ``code`` is the CUDA error (0: none reported)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Stream(Protocol):
    """A stream of one device (``torch.cuda.Stream`` or the stand-in's)."""

    def wait_stream(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...


class Event(Protocol):
    """A completion marker on a stream (``torch.cuda.Event`` or the stand-in's)."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Device(Protocol):
    """The CUDA operations of the client (see the module docstring for the call order)."""

    name: str

    def available(self) -> bool:
        """Whether this implementation can run device operations at all."""
        ...

    def index_of(self, t: torch.Tensor) -> int | None:
        """The device index holding ``t``'s storage; None for host (CPU) memory."""
        ...

    def current_device(self) -> int:
        """The calling thread's current device index."""
        ...

    def using(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Make ``index`` the calling thread's current device within the block."""
        ...

    def register_host(self, addr: int, nbytes: int, index: int) -> None:
        """Page-lock ``[addr, addr + nbytes)`` for every device (portable), with ``index`` the
        current device during the call (so no context is created on another device); leaves
        no CUDA error pending on the calling thread. Raises :class:`HostRegisterError`."""
        ...

    def unregister_host(self, addr: int) -> None:
        """Undo :meth:`register_host`. Raises :class:`HostRegisterError`."""
        ...

    def stream(self, index: int) -> Stream:
        """A new side stream of device ``index``."""
        ...

    def current_stream(self, index: int) -> Stream:
        """The calling thread's current stream of device ``index``."""
        ...

    def event(self, index: int) -> Event:
        """A new event of device ``index`` whose ``synchronize`` sleeps, not spins."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Enqueue ``dst.copy_(src)`` (same byte count, one of them a device tensor of the
        stream's device) on ``stream``; returns at once when the host side is page-locked,
        after the copy otherwise."""
        ...

    def wire_on_device(self, backend: str) -> bool:
        """Whether a process group of ``backend`` (``dist.get_backend``) carries its
        point-to-point tensors in device memory (NCCL: only there)."""
        ...

    def empty_like(self, t: torch.Tensor, index: int | None) -> torch.Tensor:
        """A new contiguous tensor of ``t``'s dtype and shape on device ``index`` (None: host)."""
        ...


# --------------------------------------------------------------------------------------- CUDA


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded into this process (for ``cudaGetLastError``, which
    torch's binding does not expose); None when none is mapped."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            return ctypes.CDLL(path)
    return None


class CudaDevice:
    """:class:`Device` on real CUDA (torch's streams and events, the runtime's registration).

    ``cudart``: the runtime binding (default ``torch.cuda.cudart()``); ``last_error``: a
    callable returning and clearing the calling thread's CUDA error (default: the loaded
    runtime's ``cudaGetLastError``). Both exist so the bookkeeping can be exercised without a
    GPU; production leaves them None.
    """

    name = "cuda"

    def __init__(self, cudart: Any = None, last_error: Callable[[], int] | None = None) -> None:
        self._cudart = cudart
        self._last_error = last_error

    def available(self) -> bool:
        return self._cudart is not None or torch.cuda.is_available()

    def index_of(self, t: torch.Tensor) -> int | None:
        d = t.device
        if d.type != "cuda":
            return None
        return d.index if d.index is not None else 0

    def current_device(self) -> int:
        if self._cudart is not None and not torch.cuda.is_available():
            return 0
        return int(torch.cuda.current_device())

    @contextlib.contextmanager
    def using(self, index: int) -> Iterator[None]:
        if not torch.cuda.is_available():
            yield
            return
        with torch.cuda.device(index):
            yield

    def _runtime(self) -> Any:
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return self._cudart

    def _clear_error(self) -> None:
        if self._last_error is None:
            lib = _loaded_cudart()
            if lib is None:
                return
            fn = lib.cudaGetLastError
            fn.restype = ctypes.c_int
            self._last_error = lambda: int(fn())
        self._last_error()

    def register_host(self, addr: int, nbytes: int, index: int) -> None:
        rt = self._runtime()
        with self.using(index):
            try:
                err = rt.cudaHostRegister(addr, nbytes, HOST_REGISTER_PORTABLE)
            except Exception as exc:  # a binding without the call
                raise HostRegisterError(0, f"cudaHostRegister is unavailable: {exc}") from exc
            code = int(getattr(err, "value", err))
            if code != 0:
                # The failed call left its error as the thread's "last error": the next kernel
                # launch check on this thread (torch's) would raise it as its own.
                self._clear_error()
                raise HostRegisterError(code, f"cudaHostRegister returned error {code}")

    def unregister_host(self, addr: int) -> None:
        code = int(getattr(self._runtime().cudaHostUnregister(addr), "value", 0) or 0)
        if code != 0:
            self._clear_error()
            raise HostRegisterError(code, f"cudaHostUnregister returned error {code}")

    def stream(self, index: int) -> Stream:
        return torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]

    def current_stream(self, index: int) -> Stream:
        return torch.cuda.current_stream(index)

    def event(self, index: int) -> Event:
        with self.using(index):
            return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        index = getattr(stream, "device_index", None)
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            # The stream context makes the stream's device current too, so the copy is enqueued
            # on this stream and not on its device tensor's current stream.
            if index is not None and torch.cuda.current_device() != index:
                raise DeviceError(f"a copy for device {index} ran on another device")
            dst.copy_(src, non_blocking=True)

    def wire_on_device(self, backend: str) -> bool:
        return "nccl" in backend

    def empty_like(self, t: torch.Tensor, index: int | None) -> torch.Tensor:
        where = torch.device("cpu") if index is None else torch.device("cuda", index)
        return torch.empty(t.shape, dtype=t.dtype, device=where)


# ----------------------------------------------------------------------------------- stand-in


class _StandInStream:
    """A FIFO of work run by one worker thread (a CUDA stream's order, on the CPU)."""

    def __init__(self, owner: StandInDevice, index: int) -> None:
        self.owner = owner
        self.device_index = index
        self._q: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._enqueued = 0
        self._done = 0
        self._released = 0
        self.error: BaseException | None = None
        self._worker = threading.Thread(
            target=self._run, name=f"standin-stream-{index}", daemon=True
        )
        self._worker.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            seq, fn = item
            if self.owner.hold:
                with self._cond:
                    self._cond.wait_for(lambda s=seq: self._released >= s)  # type: ignore[misc]
            elif self.owner.latency_s:
                time.sleep(self.owner.latency_s)
            try:
                fn()
            except BaseException as exc:  # surfaced by the next wait on this stream
                self.error = exc
            with self._cond:
                self._done = seq
                self._cond.notify_all()

    def enqueue(self, fn: Callable[[], None]) -> int:
        with self._cond:
            self._enqueued += 1
            seq = self._enqueued
        self._q.put((seq, fn))
        return seq

    @property
    def tail(self) -> int:
        with self._cond:
            return self._enqueued

    def wait_for(self, seq: int) -> None:
        """Block until the work up to ``seq`` ran (releasing it first in hold mode)."""
        with self._cond:
            self._released = max(self._released, seq)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._done >= seq)
        if self.error is not None:
            err, self.error = self.error, None
            raise DeviceError(f"a copy on stand-in device {self.device_index} failed: {err}")

    def done(self, seq: int) -> bool:
        with self._cond:
            return self._done >= seq

    def wait_stream(self, stream: Any) -> None:
        other: _StandInStream = stream
        seq = other.tail
        if other is not self and seq:
            self.enqueue(lambda: other.wait_for(seq))

    def synchronize(self) -> None:
        self.wait_for(self.tail)

    def close(self, timeout: float = 30.0) -> None:
        """Release held work, let the worker run what was queued, and join it (``timeout``
        seconds). A daemon worker still inside a torch op when the interpreter finalizes dies in
        ``pthread_exit`` while re-taking the GIL, and that unwinds through C++ code as
        ``terminate called without an active exception`` (SIGABRT at exit)."""
        with self._cond:
            self._released = self._enqueued
            self._cond.notify_all()
        self._q.put(None)
        if self._worker is not threading.current_thread():
            self._worker.join(timeout)


class _StandInEvent:
    def __init__(self, index: int) -> None:
        self.device_index = index
        self._at: tuple[_StandInStream, int] | None = None

    def record(self, stream: Any = None) -> None:
        s: _StandInStream = stream
        if s.device_index != self.device_index:
            raise DeviceError(
                f"an event of stand-in device {self.device_index} recorded on a stream of "
                f"device {s.device_index}"
            )
        self._at = (s, s.tail)

    def synchronize(self) -> None:
        if self._at is not None:
            self._at[0].wait_for(self._at[1])

    def query(self) -> bool:
        return self._at is None or self._at[0].done(self._at[1])


class StandInDevice:
    """:class:`Device` on the CPU with CUDA's asynchrony (see the module docstring).

    ``devices``: how many devices (indices 0..devices-1). ``latency_s``: how long each piece of
    stream work waits before it runs, seconds (0: as soon as the worker gets to it). ``hold``:
    stream work runs only when a wait needs it (``synchronize``, an event's ``synchronize``, a
    ``wait_stream`` that is itself waited for): the most adverse schedule, so a missing wait
    always shows as bytes not yet in place. ``register_error``: when set, every
    :meth:`register_host` fails with this CUDA error code. ``registrations`` records every
    successful call as ``addr -> (nbytes, current device during the call, flags)``;
    ``register_calls`` counts calls (failed ones too). ``nccl``: process groups are taken to
    carry device tensors only (:meth:`wire_on_device`), as an NCCL-only job's does, whatever
    their backend (a gloo group then carries the stand-in's device tensors, which are CPU
    memory): the NCCL logic of the replica exchange runs on gloo.
    """

    name = "stand-in"

    def __init__(
        self,
        devices: int = 1,
        *,
        latency_s: float = 0.0,
        hold: bool = False,
        register_error: int | None = None,
        nccl: bool = False,
    ) -> None:
        self.devices = devices
        self.nccl = nccl
        self.latency_s = latency_s
        self.hold = hold
        self.register_error = register_error
        self.register_gate: threading.Event | None = None
        """When set, :meth:`register_host` blocks until the event is set (a slow registration
        of a large slot, made observable)."""
        self.registrations: dict[int, tuple[int, int, int]] = {}
        self.register_calls = 0
        self.copies: list[tuple[int, str]] = []
        """Every copy: (device index, "d2h" | "h2d"), in enqueue order."""
        self.pinned_copies = 0
        """Copies whose host side was registered (asynchronous, at the link's speed)."""
        self._owned: dict[int, tuple[int, torch.UntypedStorage]] = {}
        """Storage address -> (device index, the storage, held so the address stays its)."""
        self._local = threading.local()
        self._lock = threading.Lock()
        self._streams: list[_StandInStream] = []
        self._current = [_StandInStream(self, i) for i in range(devices)]

    # -- stand-in device memory -----------------------------------------------------------------
    def tensor(self, t: torch.Tensor, index: int = 0) -> torch.Tensor:
        """A copy of ``t`` in the stand-in's device ``index`` memory (a CPU tensor this device
        reports as its own: :meth:`index_of`)."""
        self._check(index)
        out = t.detach().clone()
        st = out.untyped_storage()
        with self._lock:
            self._owned[st.data_ptr()] = (index, st)
        return out

    def _check(self, index: int) -> None:
        if not 0 <= index < self.devices:
            raise DeviceError(f"no stand-in device {index} (devices: {self.devices})")

    # -- Device ---------------------------------------------------------------------------------
    def available(self) -> bool:
        return True

    def index_of(self, t: torch.Tensor) -> int | None:
        if t.device.type != "cpu":
            return None
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            held = self._owned.get(ptr)
        return None if held is None else held[0]

    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    @contextlib.contextmanager
    def using(self, index: int) -> Iterator[None]:
        self._check(index)
        prev = self.current_device()
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = prev

    def register_host(self, addr: int, nbytes: int, index: int) -> None:
        self._check(index)
        with self._lock:
            self.register_calls += 1
        gate = self.register_gate
        if gate is not None:
            gate.wait()
        if self.register_error is not None:
            raise HostRegisterError(
                self.register_error, f"cudaHostRegister returned error {self.register_error}"
            )
        with self.using(index), self._lock:
            if any(
                a < addr + nbytes and addr < a + n for a, (n, _, _) in self.registrations.items()
            ):
                raise HostRegisterError(712, "cudaErrorHostMemoryAlreadyRegistered")
            self.registrations[addr] = (nbytes, self.current_device(), HOST_REGISTER_PORTABLE)

    def unregister_host(self, addr: int) -> None:
        with self._lock:
            if self.registrations.pop(addr, None) is None:
                raise HostRegisterError(713, "cudaErrorHostMemoryNotRegistered")

    def is_registered(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies in one registered range."""
        with self._lock:
            return any(
                a <= addr and addr + nbytes <= a + n for a, (n, _, _) in self.registrations.items()
            )

    def stream(self, index: int) -> Stream:
        self._check(index)
        s = _StandInStream(self, index)
        with self._lock:
            self._streams.append(s)
        return s

    def current_stream(self, index: int) -> Stream:
        self._check(index)
        return self._current[index]

    def event(self, index: int) -> Event:
        self._check(index)
        return _StandInEvent(index)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        s: _StandInStream = stream  # type: ignore[assignment]
        di, si = self.index_of(dst), self.index_of(src)
        if (di is None) == (si is None):
            raise DeviceError("a stand-in copy moves bytes between host and device memory")
        index = di if di is not None else si
        assert index is not None
        if index != s.device_index:
            raise DeviceError(
                f"a copy of stand-in device {index}'s tensor enqueued on a stream of device "
                f"{s.device_index}: PyTorch would run it on device {index}'s current stream, "
                "unordered with this stream's events; use a stream of that device"
            )
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise DeviceError("a stand-in copy between tensors of different byte counts")
        host = src if si is None else dst
        self.copies.append((index, "d2h" if si is not None else "h2d"))
        pinned = self.is_registered(host.data_ptr(), host.numel() * host.element_size())
        if pinned:
            self.pinned_copies += 1
        src_bytes = src.detach().reshape(-1).view(torch.uint8)

        def run() -> None:
            dst.view(-1).view(torch.uint8).copy_(src_bytes)

        seq = s.enqueue(run)
        if not pinned:  # pageable memory: CUDA copies synchronously
            s.wait_for(seq)

    def wire_on_device(self, backend: str) -> bool:
        return self.nccl or "nccl" in backend

    def empty_like(self, t: torch.Tensor, index: int | None) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype)
        return out if index is None else self.tensor(out, index)

    def close(self) -> None:
        """Stop the stream workers after the work queued so far (held work is released) and
        join them."""
        with self._lock:
            streams = self._streams + self._current
            self._streams = []
        for s in streams:
            s.close()


def copy_now(dev: Device, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (contiguous, same bytes; one on a device, one on the host)
    through ``dev`` on a side stream of the device side that waits for its current stream, and
    return when the bytes are in place. Raises :class:`DeviceError` when neither side is a
    device tensor of ``dev``."""
    index = dev.index_of(dst)
    if index is None:
        index = dev.index_of(src)
    if index is None:
        raise DeviceError("copy_now moves bytes between host and device memory")
    stream = dev.stream(index)
    stream.wait_stream(dev.current_stream(index))
    dev.copy(dst, src, stream)
    event = dev.event(index)
    event.record(stream)
    event.synchronize()


_ACTIVE: list[Device] = []


def active() -> Device:
    """The :class:`Device` the client uses now (:class:`CudaDevice` unless :func:`use` put a
    stand-in in place)."""
    if not _ACTIVE:
        _ACTIVE.append(CudaDevice())
    return _ACTIVE[-1]


@contextlib.contextmanager
def use(device: Device) -> Iterator[Device]:
    """Make ``device`` the process's :func:`active` device within the block (tests; a process
    may also call it once at start-up, e.g. a test's rank process)."""
    active()
    _ACTIVE.append(device)
    try:
        yield device
    finally:
        _ACTIVE.remove(device)


def install(device: Device) -> None:
    """Make ``device`` the process's :func:`active` device from now on."""
    active()
    _ACTIVE.append(device)
