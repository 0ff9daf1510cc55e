"""Entry point of ``strata sidecar``: configuration errors exit 2 with a message naming the setting."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys

from strata.config import StrataConfig
from strata.errors import ConfigError, PolicyError, TierError
from strata.sidecar.logs import setup_logging

log = logging.getLogger("strata.sidecar")

EXIT_CONFIG = 2
EXIT_FAILED = 1


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc ``mallopt`` parameters (malloc.h)."""
HEAP_MMAP_THRESHOLD = 1024 * 1024


def bound_heap() -> None:
    """Make glibc return large transfer buffers to the kernel when they are freed.

    Why: glibc raises its mmap threshold to the size of any mmapped block that is freed (up to
    32 MiB), after which every later multi-MiB buffer comes from the per-thread heaps and stays
    counted against the container when freed. With 8 upload threads that retention, not the
    buffers in use, was most of the sidecar's private memory (bench/gcs_upload_memory.py: 292
    -> 172 MiB peak for a 0.25 GiB shard). A fixed threshold keeps buffers >= 1 MiB mmapped.
    No-op where glibc's mallopt is missing.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, HEAP_MMAP_THRESHOLD)


def run_sidecar(log_level: str = "INFO") -> int:
    """Run the sidecar until SIGTERM; 0 after a clean flush, 1 when it failed, 2 on bad config."""
    setup_logging(log_level)
    # Files and directories the sidecar creates in the shared RAM volume stay group-writable,
    # so a trainer running under another UID of the pod's fsGroup can use them.
    os.umask(0o002)
    # No process-wide nice here: start-up, the readiness probe and the termination flush run at
    # the pod's priority; only steady-state promotion threads lower themselves
    # (strata.sidecar.priority).
    bound_heap()
    try:
        config = StrataConfig.from_env()
        from strata.sidecar.service import Sidecar

        sidecar = Sidecar(config)
    except (ConfigError, PolicyError) as exc:
        print(f"strata sidecar: {exc}", file=sys.stderr)
        log.error("invalid configuration: %s", exc, extra={"event": "config_error"})
        return EXIT_CONFIG
    except (TierError, OSError) as exc:
        return _cannot_start(exc)
    try:
        return sidecar.serve()
    except (TierError, OSError) as exc:
        # Start-up problems of the environment (RAM directory unusable, metrics port taken,
        # no GCS credentials): one clear line, not a traceback.
        return _cannot_start(exc)


def _cannot_start(exc: BaseException) -> int:
    hint = ""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        hint = " (metrics_port is taken: set another port in the sidecar configuration)"
    print(f"strata sidecar: cannot start: {exc}{hint}", file=sys.stderr)
    log.error("cannot start: %s%s", exc, hint, extra={"event": "start_error"})
    return EXIT_FAILED
