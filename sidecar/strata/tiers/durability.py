"""POSIX durability primitives shared by every file-backed store (PVC, RAM, peer copies).

The commit protocol of a file store is: write under a temporary name, ``fsync`` the file,
``rename``/``link`` it to its final name, ``fsync`` the directory (a create, rename or unlink
is only durable once its directory is). These helpers are that protocol's steps, written once.
Every function raises ``OSError`` as the system call did (ENOSPC, EDQUOT, EIO ...); callers
translate it into their tier's error.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory so a create/rename/unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file written earlier (by another descriptor or another process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, payload: bytes) -> None:
    """Write all of ``payload`` to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]


def write_new(path: Path, payload: bytes, *, fsync: bool = True) -> None:
    """Create ``path`` (which must not exist: ``O_EXCL``) holding ``payload``, fsynced when
    ``fsync``. The caller links or renames it into place and removes it on failure; raises
    ``FileExistsError`` when ``path`` exists and ``OSError`` as the system calls did."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, payload)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A fresh temporary name next to ``path`` (``<name>.tmp-<pid>-<random>``: never a final
    name, so listings and garbage collection can tell it apart)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_atomic(path: Path, payload: bytes) -> None:
    """Replace ``path`` with ``payload`` atomically and durably: temporary file, fsync, rename,
    fsync of the directory. A reader sees the old content or the whole new one; on failure the
    temporary file is removed and the error re-raised."""
    tmp = temp_name(path)
    try:
        write_new(tmp, payload)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
