"""RAM-tier heartbeat and janitor for the ``hostPath`` medium (docs/architecture.md "RAM tier
and the training stall").

With ``medium: HostPath`` the RAM tier is a node tmpfs shared by every job on the node, so it
survives a pod rescheduled onto the same node, but nothing deletes a finished job's data. Each
sidecar therefore touches ``<ram root>/<job id>/.strata-heartbeat`` (:data:`HEARTBEAT_NAME`)
every few seconds, and ``strata janitor`` (a DaemonSet) removes job directories whose heartbeat
is older than a grace period. The sidecar itself never touches another job's directory.

The janitor only removes directories that are recognisably Strata job data: a heartbeat file, or
a ``steps/`` directory and nothing else unexpected at the top level; anything else is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from strata.constants import HEARTBEAT_NAME as HEARTBEAT_NAME

log = logging.getLogger("strata.janitor")

_STRATA_ENTRIES = frozenset({"steps", "slots", HEARTBEAT_NAME, ".strata"})


def touch_heartbeat(ram_root: Path, job_id: str) -> Path:
    """Create or refresh this job's heartbeat (mtime = now)."""
    path = ram_root / job_id / HEARTBEAT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.utime(path)
    return path


@dataclass
class JanitorResult:
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Directories that do not look like Strata job data (never touched)."""


def _newest_mtime(job_dir: Path) -> float:
    newest = job_dir.stat().st_mtime
    for root, dirs, files in os.walk(job_dir):
        for name in dirs + files:
            try:
                newest = max(newest, (Path(root) / name).lstat().st_mtime)
            except FileNotFoundError:
                continue
    return newest


def sweep(ram_root: Path, grace_seconds: float, now: float | None = None) -> JanitorResult:
    """Remove job directories under ``ram_root`` idle for more than ``grace_seconds``.

    Idle = heartbeat mtime older than the grace; a Strata-looking directory without a heartbeat
    (written by a sidecar that died before its first heartbeat) counts its newest file instead.
    """
    now = time.time() if now is None else now
    result = JanitorResult()
    if not ram_root.is_dir():
        return result
    for job_dir in sorted(p for p in ram_root.iterdir() if p.is_dir() and not p.is_symlink()):
        entries = {p.name for p in job_dir.iterdir()}
        heartbeat = job_dir / HEARTBEAT_NAME
        if HEARTBEAT_NAME in entries:
            last = heartbeat.stat().st_mtime
        elif "steps" in entries and entries <= _STRATA_ENTRIES:
            last = _newest_mtime(job_dir)
        else:
            result.skipped.append(job_dir.name)
            continue
        if now - last <= grace_seconds:
            result.kept.append(job_dir.name)
            continue
        log.info(
            "removing RAM data of job %s: idle for %.0fs (grace %.0fs)",
            job_dir.name,
            now - last,
            grace_seconds,
            extra={"event": "janitor_remove", "job_id": job_dir.name},
        )
        shutil.rmtree(job_dir, ignore_errors=True)
        result.removed.append(job_dir.name)
    return result
