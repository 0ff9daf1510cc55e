"""The operator process' memory: TLS read buffers, returning freed heap, and a debug snapshot.

Why (measured, see ``e2e/test_operator_memory.py``): the operator's memory under report load is
dominated by its open TLS connections, not by what it remembers. Every sidecar report is a new
HTTPS connection, and each one waits for the status patch that holds its report (about one
``--status-interval``), so the receiver holds as many connections as reports arrive in that time,
more when the apiserver is slow. Two things made that memory large and kept it after the load:

* CPython's asyncio TLS transport (``asyncio.sslproto.SSLProtocol``) allocates a read buffer of
  ``SSLProtocol.max_size`` (256 KiB) per connection, for a report body of about 1 KiB;
  :func:`limit_tls_buffers` makes it :data:`TLS_READ_BUFFER_BYTES`.
* glibc's malloc returns freed memory to the kernel only from the top of a heap; the buffers and
  OpenSSL's per-connection state freed when a burst of connections closes sit below live
  objects, so the RSS stays at the burst's peak (fragmentation, not a leak: ``malloc_trim``
  gives it back). :data:`TRIMMER` calls ``malloc_trim(0)`` after a burst, in its own thread.

Debugging: with ``STRATA_TRACEMALLOC=<file>`` in the environment the operator starts
``tracemalloc`` and, on ``SIGUSR2``, writes its RSS and the 40 largest Python allocation sites
(5 frames each) to ``<file>`` (:func:`install_debug_snapshot`). It costs CPU and memory: for
investigations only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("strata.memory")

TLS_READ_BUFFER_BYTES = 32 * 1024
"""Read buffer of each asyncio TLS connection; bytes. Two TLS records (16 KiB of plaintext each,
RFC 8446 5.1): a report or an admission review needs a few reads, a large watch response more
reads of the same total; the CPython default is 256 KiB per connection."""

TRIM_PERIOD_SECONDS = 10.0
"""How often :class:`HeapTrimmer` looks whether connections closed since its last trim; s."""

ENV_TRACEMALLOC = "STRATA_TRACEMALLOC"


def limit_tls_buffers(size: int = TLS_READ_BUFFER_BYTES) -> None:
    """Make every asyncio TLS connection of this process read into a ``size``-byte buffer
    (process-wide: the report receiver, the webhook server and kopf's API client)."""
    from asyncio import sslproto

    if size < 16 * 1024:
        raise ValueError(f"TLS read buffer of {size} bytes is below one TLS record (16 KiB)")
    sslproto.SSLProtocol.max_size = size


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def release_free_memory() -> bool:
    """Return the free pages of the C heap to the kernel (glibc ``malloc_trim(0)``); blocking, a
    few milliseconds per hundred MiB. False where the C library has no ``malloc_trim`` (musl)."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


class HeapTrimmer:
    """Gives freed heap back after bursts of requests: :meth:`closed` counts a finished request
    (report or admission review; callable from any thread or event loop); a daemon thread started
    by :meth:`start` calls :func:`release_free_memory` at most once per ``period`` seconds, and
    only when requests finished since its last trim."""

    def __init__(self, period: float = TRIM_PERIOD_SECONDS) -> None:
        self.period = period
        self.finished = 0
        self.trims = 0
        self._seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def closed(self) -> None:
        self.finished += 1  # a count lost to a race only delays a trim

    def trim_if_used(self) -> bool:
        """Trim when requests finished since the last trim; whether it trimmed."""
        if self.finished == self._seen:
            return False
        self._seen = self.finished
        if release_free_memory():
            self.trims += 1
            return True
        return False

    def start(self) -> None:
        """Start the trimming thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="strata-heap-trim", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.trim_if_used()


TRIMMER = HeapTrimmer()
"""The process' trimmer: the report receiver and the admission webhook count their requests."""


def rss_mib(pid: int | None = None) -> float:
    """Resident set size of process ``pid`` (None: this one) from ``/proc``; MiB."""
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError("no VmRSS in /proc status")


def install_debug_snapshot() -> bool:
    """With ``$STRATA_TRACEMALLOC`` set to a path: start ``tracemalloc`` (5 frames) and write a
    snapshot summary to that path on ``SIGUSR2``. Returns whether it was installed. Call from the
    main thread (signal handlers)."""
    path = os.environ.get(ENV_TRACEMALLOC)
    if not path:
        return False
    import tracemalloc

    tracemalloc.start(5)
    lock = threading.Lock()

    def dump(*_: object) -> None:
        with lock:
            snapshot = tracemalloc.take_snapshot()
            stats = snapshot.statistics("traceback")
            traced, peak = tracemalloc.get_traced_memory()
            lines = [
                f"time {time.time():.0f} rss {rss_mib():.1f} MiB traced {traced / 2**20:.1f} MiB "
                f"(peak {peak / 2**20:.1f} MiB) in {sum(s.count for s in stats)} blocks"
            ]
            for stat in stats[:40]:
                lines.append(f"{stat.size / 2**20:8.2f} MiB {stat.count:8d} blocks")
                lines.extend(f"    {frame}" for frame in stat.traceback.format())
            Path(path).write_text("\n".join(lines) + "\n")

    signal.signal(signal.SIGUSR2, dump)
    log.warning("tracemalloc on: SIGUSR2 writes a snapshot to %s", path)
    return True
