"""Graceful termination of a training process: SIGTERM -> final RAM save -> durable flush -> exit.

When Kubernetes terminates a pod (spot VM preemption, node drain, eviction, a JobSet restart,
``kubectl delete``) every main container gets SIGTERM and, ``terminationGracePeriodSeconds``
later, SIGKILL. Work since the newest durable step is lost unless it reaches a durable tier in
between. Two facts of real nodes shape this module:

- a trainer that is PID 1 of its container and has no SIGTERM handler ignores SIGTERM (the
  kernel drops signals PID 1 does not handle), so the kubelet waits the whole grace period;
- a native sidecar gets its own SIGTERM only after every main container exited (a kubelet gave
  it 2 s after such a trainer), so the sidecar must hear of the termination from the trainer.

:class:`Termination` (``Checkpointer.termination``, installed by :class:`strata.Checkpointer`
from the main thread unless ``STRATA_TERMINATION_HANDLER=0``) installs a SIGTERM handler that:

1. records the signal and wakes a notifier thread, which tells the sidecar at once
   (``POST /v1/terminate``): the sidecar starts flushing the newest committed RAM step to the
   fastest durable tier, knowing the deadline (signal time + grace period - its margin); a
   loop that polls :meth:`should_stop` announces its final save, and the sidecar then holds its
   first pass a few seconds for it rather than copy a large state twice;
2. calls the handler that was installed before it (the user's), if any, then the callbacks
   given to :meth:`Termination.add_callback`;
3. if nobody will stop the training loop -- it never called :meth:`should_stop`, and there was
   no previous Python handler and no callback -- raises ``SystemExit(128 + SIGTERM)`` once the
   notice is delivered, as SIGTERM's default action would (also as PID 1). The sidecar's flush
   of the newest committed RAM step carries on without the trainer.

A training loop that polls ``ckpt.should_stop(step, state)`` between steps gets more: at the
first safe point after the signal, the current step is saved to RAM if it is newer than the last
saved one, the sidecar is asked to make that step durable, and the call waits for it within the
budget: the grace period (``StrataConfig.termination_grace_seconds``, which the webhook sets to
the pod's ``terminationGracePeriodSeconds``; env ``STRATA_TERMINATION_GRACE_SECONDS`` overrides
it) minus :data:`EXIT_MARGIN_SECONDS` since the signal. It then returns True; the loop ends and
the process exits, with :attr:`Termination.exit_code` so that a Job does not count a preempted
pod as succeeded::

    for step in range(start, steps):
        train_step()
        if ckpt.should_save(step):
            ckpt.save(step, state)
        if ckpt.should_stop(step, state):   # True once SIGTERM arrived; state saved and flushed
            break
    ...
    if ckpt.termination.requested:
        sys.exit(ckpt.termination.exit_code)

With torch.distributed initialized, ``should_stop`` all-reduces the flag over the process group
(one small collective per call) so that every rank stops at the same step; every rank must then
call it at the same steps. ``agree=False`` skips it.

Limits: the handler runs only when the main thread executes Python bytecode (CPython), so a
long-running C++ call delays it; the notice does not wait for it (it is sent by the notifier
thread as soon as the handler ran). A second handler installed later by the user replaces this
one unless it chains to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from strata.config import StrataConfig
from strata.errors import StrataError
from strata.protocol import TerminateReply

log = logging.getLogger("strata.client")

ENV_TERMINATION_HANDLER = "STRATA_TERMINATION_HANDLER"
"""``0``/``false``: the Checkpointer installs no SIGTERM handler."""
EXIT_MARGIN_SECONDS = 4.0
"""Seconds of the grace period the trainer keeps after waiting for the flush (exit, teardown)."""
NOTICE_WAIT_SECONDS = 2.0
"""How long the handler waits for the notice to reach the sidecar before it exits the process
(only when nobody polls :meth:`Termination.should_stop`)."""

SignalHandler = Callable[[int, FrameType | None], Any] | int | None


class _Checkpointer(Protocol):
    """What :class:`Termination` uses of :class:`strata.Checkpointer`."""

    config: StrataConfig
    job_id: str
    rank: int
    process_group: Any

    @property
    def last_saved_step(self) -> int | None: ...

    def save(self, step: int, state: Any) -> bool: ...

    def wait(self, timeout: float | None = None) -> None: ...


class Termination:
    """The SIGTERM handler and final flush of one :class:`strata.Checkpointer` (see the module
    docstring). ``install``: None reads ``STRATA_TERMINATION_HANDLER`` (default on)."""

    def __init__(self, ckpt: _Checkpointer, install: bool | None = None) -> None:
        self._ckpt = ckpt
        self.grace_seconds = ckpt.config.termination_grace_seconds
        self.signal_time: float | None = None
        """``time.monotonic()`` when the first SIGTERM arrived (None: none yet)."""
        self.signum: int | None = None
        self.outcome: TerminateReply | None = None
        """The sidecar's answer to the final flush request (None: not asked, or no answer)."""
        self.notice: TerminateReply | None = None
        """The sidecar's answer to the notice sent from the handler."""
        self._polled = False
        self._finished = False
        self._callbacks: list[Callable[[], None]] = []
        self._previous: SignalHandler = None
        self._installed = False
        self._notified = threading.Event()
        if install is None:
            install = os.environ.get(ENV_TERMINATION_HANDLER, "1").lower() not in ("0", "false")
        if install:
            self.install()

    # -- signal handling ----------------------------------------------------------------------------

    @property
    def requested(self) -> bool:
        """SIGTERM arrived."""
        return self.signal_time is not None

    @property
    def exit_code(self) -> int:
        """What the process should exit with after stopping for the signal: 128 + signal number
        (143 for SIGTERM), so that Kubernetes counts the pod as terminated, not succeeded."""
        return 128 + (self.signum or signal.SIGTERM)

    def install(self) -> bool:
        """Install the SIGTERM handler (chaining to the current one). Only the main thread can
        install signal handlers: from another thread this logs and returns False."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.info(
                "strata: the termination handler is not installed (signal handlers can only be "
                "installed from the main thread); call ckpt.termination.install() there"
            )
            return False
        self._previous = signal.getsignal(signal.SIGTERM)
        _NOTIFIER.add(self)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from the SIGTERM handler (main thread), after the previous handler.
        A callback means the program stops by itself: the handler then never exits the process."""
        self._callbacks.append(callback)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_time is None:
            self.signal_time = time.monotonic()
            self.signum = signum
            _NOTIFIER.wake()
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        for callback in self._callbacks:
            callback()
        nobody_stops = not (self._polled or callable(previous) or self._callbacks)
        if nobody_stops and previous != signal.SIG_IGN:
            # Nobody stops the training loop: end the process as SIGTERM's default action
            # would (which PID 1 does not get), once the sidecar has the notice.
            self._notified.wait(NOTICE_WAIT_SECONDS)
            raise SystemExit(128 + signum)

    def send_notice(self) -> None:
        """Tell the sidecar the pod is terminating (the notifier thread calls it after SIGTERM;
        never raises)."""
        if self.signal_time is None or self._notified.is_set():
            return
        log.warning(
            "strata: SIGTERM received: asking the sidecar to flush the newest committed step "
            "to the durable tier (grace period %.0fs)",
            self.grace_seconds,
            extra={"event": "termination_signal"},
        )
        try:
            client = self._client()
            if client is not None:
                # A loop that polls will ask for its final step: the sidecar may wait for it
                # rather than copy the previous step first.
                self.notice = client.terminate(
                    self._ckpt.job_id,
                    self._ckpt.rank,
                    self.since_signal(),
                    final_save=self._polled and not self._finished,
                )
        except StrataError as exc:
            log.warning("strata: the sidecar did not take the termination notice: %s", exc)
        except Exception:
            log.exception("strata: the termination notice failed")
        finally:
            self._notified.set()

    def _client(self) -> Any:
        from strata.client.sidecar_client import SidecarClient

        path = self._ckpt.config.socket
        if not path.is_socket():
            log.warning(
                "strata: no sidecar socket at %s: the newest steps stay in the RAM tier only",
                path,
            )
            return None
        return SidecarClient(path, timeout=5.0)

    # -- the training loop's side ------------------------------------------------------------------

    def since_signal(self) -> float:
        """Seconds since SIGTERM (0 before it)."""
        return 0.0 if self.signal_time is None else max(0.0, time.monotonic() - self.signal_time)

    def budget_left(self) -> float:
        """Seconds the trainer may still spend on the final save and flush (>= 0)."""
        return max(0.0, self.grace_seconds - EXIT_MARGIN_SECONDS - self.since_signal())

    def should_stop(self, step: int | None = None, state: Any = None, agree: bool = True) -> bool:
        """True once SIGTERM arrived (on any rank, when ``agree`` and torch.distributed is
        initialized). With ``step`` and ``state``, the first True also runs :meth:`finish`."""
        self._polled = True
        stop = self.signal_time is not None
        if agree:
            stop = _any_rank(stop, self._ckpt.process_group)
        if stop and self.signal_time is None:
            # Another rank's pod is terminating: this rank stops at the same step.
            self.signal_time = time.monotonic()
        if stop and step is not None and state is not None and not self._finished:
            self.finish(step, state)
        return stop

    def finish(self, step: int, state: Any) -> TerminateReply | None:
        """Save ``step`` to RAM if it is newer than the last saved step, then have the sidecar
        make the newest saved step durable, waiting within :meth:`budget_left`. Never raises for
        a failed save or an absent sidecar (logged); returns the sidecar's answer (None: none)."""
        self._finished = True
        if self.signal_time is None:
            self.signal_time = time.monotonic()
        ckpt = self._ckpt
        last = ckpt.last_saved_step
        if (last is None or step > last) and not ckpt.save(step, state):
            log.error(
                "strata: the final save of step %d failed; flushing step %s instead",
                step,
                ckpt.last_saved_step,
            )
        try:
            ckpt.wait(timeout=self.budget_left())  # the checksum pass the sidecar would redo
        except TimeoutError:
            log.warning("strata: the final checksum pass did not finish; the sidecar seals it")
        target = ckpt.last_saved_step
        if target is None:
            log.warning("strata: terminating with no step saved: nothing to flush")
            return None
        client = self._client()
        if client is None:
            return None
        try:
            reply: TerminateReply = client.terminate(
                ckpt.job_id,
                ckpt.rank,
                self.since_signal(),
                wait_step=target,
                timeout=self.budget_left(),
            )
        except StrataError as exc:
            log.error("strata: the termination flush of step %d was not confirmed: %s", target, exc)
            return None
        self.outcome = reply
        durable = reply.durable_step is not None and reply.durable_step >= target
        (log.info if durable else log.error)(
            "strata: termination flush: step %d %s on %s (%.1fs since SIGTERM%s)",
            target,
            "is durable" if durable else f"NOT durable ({reply.message})",
            reply.tier,
            self.since_signal(),
            "" if reply.fit is not False else ", did not fit the grace period",
            extra={"event": "termination_flush", "step": target, "durable": durable},
        )
        return reply

    def close(self) -> None:
        """Restore the previous SIGTERM handler (if this one is still installed) and stop the
        notifier thread."""
        if not self._installed:
            return
        self._installed = False
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(signal.SIGTERM) == self._handle:
                    signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
        _NOTIFIER.remove(self)


class _Notifier:
    """One thread per process that sends the notices of every installed :class:`Termination`.

    A signal handler must not block nor take locks the interrupted code may hold, so it only
    writes a byte to a pipe (non-blocking); this thread wakes on it and does the socket calls.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: list[Termination] = []
        self._wake_w = -1
        self._pid = -1

    def add(self, member: Termination) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: a pipe of its own
                r, w = os.pipe()
                os.set_blocking(w, False)
                self._wake_w, self._pid = w, os.getpid()
                threading.Thread(
                    target=self._run, args=(r,), name="strata-termination-notice", daemon=True
                ).start()
            self._members.append(member)

    def remove(self, member: Termination) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._members.remove(member)

    def wake(self) -> None:
        """From the signal handler: a write of one byte, nothing else."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"t")

    def _run(self, fd: int) -> None:
        while True:
            try:
                os.read(fd, 1)
            except OSError:
                return
            with self._lock:
                members = list(self._members)
            for member in members:
                member.send_notice()


_NOTIFIER = _Notifier()


def _any_rank(flag: bool, group: Any) -> bool:
    """``flag`` OR-ed over the ranks of ``group`` when torch.distributed runs with more than one
    rank; ``flag`` otherwise."""
    torch = sys.modules.get("torch")
    if torch is None:  # torch not imported: no process group can exist
        return flag
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return flag
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)):
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
