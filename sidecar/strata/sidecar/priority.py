"""CPU and I/O priority of the sidecar's threads: polite where it runs steadily, normal where it
must answer or finish on time.

Steady-state promotion copies and checksums gigabytes; at normal priority on a busy 2-core node
it slowed a 1-thread training loop by 54-115 %, at nice 19 / idle I/O by <= 4 % (bench/README.md,
interference). But the whole process at nice 19 starved exactly what must not wait: importing
the sidecar's modules took 85 s at nice 19 against 2.2 s at nice 0 on a loaded 2-core machine
(0.9 s of CPU either way), so the startupProbe failed; and a termination flush at nice 19 under a
busy trainer starves the same way outside a per-container cgroup.

So only the threads that do steady-state work lower themselves (:func:`lower_thread_priority`,
first thing in their body): the promotion loop and the peer replication loop. On Linux nice
and I/O priority are per thread (``setpriority(PRIO_PROCESS, tid)``, ``ioprio_set(IOPRIO_WHO_PROCESS,
tid)``), and a thread starts with its creator's values: the copy, checksum and upload pools a
promotion round creates are polite too, while start-up, the readiness probe, the local API and
the termination flush (a thread started by a local API handler or the main thread) keep the
process's priority.

Why not lower and raise back: lowering needs no capability (restricted Pod Security Standard),
but raising a nice value back needs CAP_SYS_NICE (or an RLIMIT_NICE the pod does not set): as
root without CAP_SYS_NICE and as any non-root user, ``setpriority`` back to 0 fails with EACCES.
So a thread that may ever need normal priority is never lowered. Not SCHED_IDLE: leaving it has
the same limit, and it can starve a thread entirely while training saturates every core.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger("strata.sidecar")

STEADY_NICE = 19
"""Nice value of steady-state promotion threads (the lowest CPU priority short of SCHED_IDLE)."""

_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13


def lower_thread_priority(nice: int = STEADY_NICE) -> None:
    """Lower the calling thread (only it, and threads it starts afterwards) to ``nice`` and the
    best-effort I/O class, level 7. Never raises: a refusal is logged at INFO."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as exc:
        log.info("could not lower the CPU priority of thread %d: %s", tid, exc)
    nr = _SYS_IOPRIO_SET.get(platform.machine())
    if nr is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = _IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT | 7
        if libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid, value) != 0:
            log.info("could not lower the I/O priority: errno %d", ctypes.get_errno())
    except OSError as exc:
        log.info("could not lower the I/O priority: %s", exc)


def thread_nice(tid: int | None = None) -> int:
    """The nice value of thread ``tid`` (default: the calling thread)."""
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())


def thread_ioprio(tid: int | None = None) -> int | None:
    """The raw I/O priority (class << 13 | level) of thread ``tid``; None where unknown."""
    nr = _SYS_IOPRIO_GET.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = int(libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid or threading.get_native_id()))
    return None if value < 0 else value
