"""Is the RAM tier's directory really in RAM? (a tmpfs or ramfs mount, not a disk)

The RAM tier's whole point is a memcpy-speed save into page-cache-only files. A RAM directory on a
disk (the default ``/strata/ram`` created on the root filesystem of a laptop or a VM, because
nobody mounted a tmpfs there) still "works" but every save becomes disk writes and the space
comes out of the root disk. :func:`check_ram_medium` tells the two apart from the kernel's mount
table (``/proc/self/mountinfo``) for the directory, or for its nearest existing parent when it
does not exist yet.

Policy: the default directory ``/strata/ram`` on a disk outside Kubernetes (no
``KUBERNETES_SERVICE_HOST``) is refused with a :class:`~strata.errors.ConfigError` that says where
to point it instead (nobody chose it: it was created on the root disk). Any other directory that
is not on a RAM disk, and any directory in a pod (where the webhook mounts an ``emptyDir`` with
``medium: Memory``, or a node's ``hostPath``), gets a loud warning. ``STRATA_ALLOW_DISK_RAM_DIR=1``
turns the refusal into the warning (a deliberate disk-backed RAM tier).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from strata.config import DEFAULT_RAM_DIR
from strata.constants import ENV_ALLOW_DISK_RAM_DIR, ENV_CONFIG
from strata.errors import ConfigError

log = logging.getLogger(__name__)

RAM_FS_TYPES = frozenset({"tmpfs", "ramfs"})
"""Filesystem types whose files live in memory only."""
MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Medium:
    """The mount holding a path: its filesystem type (``"ext4"``, ``"tmpfs"``) and mount point."""

    fs_type: str
    mount_point: str

    @property
    def in_ram(self) -> bool:
        return self.fs_type in RAM_FS_TYPES


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo`` octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.resolve()


def medium_of(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> Medium | None:
    """The mount holding ``path`` (or its nearest existing parent); None where the mount table
    cannot be read (not Linux)."""
    target = _existing(Path(path))
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: Medium | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        mount_point = _unescape(fields[4])
        if not target.is_relative_to(mount_point):
            continue
        # Later lines are mounted on top of earlier ones at the same point: >= keeps the last.
        if best is None or len(mount_point) >= len(best.mount_point):
            best = Medium(right.split()[0], mount_point)
    return best


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


_warned: set[tuple[str, str]] = set()


def check_ram_medium(
    path: str | os.PathLike[str], *, who: str, env: Mapping[str, str] | None = None
) -> Medium | None:
    """Refuse or warn when the RAM tier directory ``path`` is not on a tmpfs/ramfs mount.

    Refused (:class:`~strata.errors.ConfigError`, starting ``"Strata:"``, naming the directory,
    its filesystem and what to do) when the directory is the default ``/strata/ram`` outside
    Kubernetes: nobody chose it, so it would silently land on the root disk. A loud warning
    (once per directory and caller in a process) otherwise: a directory chosen explicitly, any
    directory in a pod (``KUBERNETES_SERVICE_HOST`` set), or with ``STRATA_ALLOW_DISK_RAM_DIR=1``.
    ``who`` names the caller (``"Checkpointer"``, ``"strata sidecar"``); ``env``: the environment
    to read (default ``os.environ``). Returns the medium found (None: unknown, nothing checked).
    """
    environ = os.environ if env is None else env
    medium = medium_of(path)
    if medium is None or medium.in_ram:
        return medium
    shown = os.fspath(path)
    what = (
        f"Strata: the RAM tier directory {shown} ({who}) is on a {medium.fs_type} filesystem "
        f"mounted at {medium.mount_point}, not on a RAM disk (tmpfs): every save writes to that "
        f"disk at disk speed and its space comes out of that filesystem"
    )
    fix = (
        "point it at a tmpfs, e.g. STRATA_RAM_DIR=/dev/shm/strata (or ram_dir=, or ram.path in "
        f"{ENV_CONFIG}; the same for the trainer and its sidecar), or mount one there "
        f"(mount -t tmpfs -o size=8g tmpfs {shown})"
    )
    in_pod = bool(environ.get("KUBERNETES_SERVICE_HOST"))
    allowed = _truthy(environ.get(ENV_ALLOW_DISK_RAM_DIR))
    if os.path.normpath(shown) == DEFAULT_RAM_DIR and not in_pod and not allowed:
        raise ConfigError(
            f"{what}. This is the default directory, used because none was set. To fix: {fix}; "
            f"or set {ENV_ALLOW_DISK_RAM_DIR}=1 to accept a disk-backed RAM tier."
        )
    if (shown, who) not in _warned:
        _warned.add((shown, who))
        log.warning("%s. To fix: %s", what, fix, extra={"event": "ram_dir_not_in_ram"})
    return medium
