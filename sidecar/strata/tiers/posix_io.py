"""File primitives of the POSIX tiers (PVC, RAM): kernel copies, the checked data write, checked
reads into a destination file, directory creation and quiet removal.

Policy (what is committed when, what a failure un-does) stays in :class:`strata.tiers.posix.PosixTier`;
these functions only move bytes and raise. Durable-metadata primitives (``fsync_dir``, temporary
names, create-new files) are in :mod:`strata.tiers.durability`.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

from strata.errors import ShardCorrupt, TierError, TierFull
from strata.format.manifest import Manifest
from strata.tiers.checked_copy import copy_checked

log = logging.getLogger(__name__)

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""errno values that mean the filesystem (or the quota) is full: :class:`TierFull`."""
_COPY_STEP = 64 * 1024 * 1024


def copy_range(src_fd: int, dst_fd: int, nbytes: int, dst_offset: int = 0) -> None:
    """Copy ``nbytes`` from offset 0 of ``src_fd`` to ``dst_offset`` of ``dst_fd`` in the kernel.

    ``os.copy_file_range`` (server-side copy on NFS 4.2, reflink where supported), falling back
    to ``os.sendfile`` and then to read/write when the pair of filesystems refuses it.
    Raises OSError (ENOSPC ...) and ``EOFError`` when the source ends early.
    """
    done = 0
    mode = "cfr"
    while done < nbytes:
        want = min(_COPY_STEP, nbytes - done)
        if mode == "cfr":
            try:
                n = os.copy_file_range(src_fd, dst_fd, want, done, dst_offset + done)
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    # tmpfs -> disk is cross-filesystem: Linux >= 5.19 refuses it with EXDEV.
                    # sendfile still copies in the kernel; read/write costs 3-4x (bench/).
                    mode = "sendfile"
                    continue
                raise
        elif mode == "sendfile":
            try:
                os.lseek(dst_fd, dst_offset + done, os.SEEK_SET)
                n = os.sendfile(dst_fd, src_fd, done, want)
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
                    mode = "rw"
                    continue
                raise
        else:
            data = os.pread(src_fd, want, done)
            n = os.pwrite(dst_fd, data, dst_offset + done) if data else 0
        if n == 0:
            raise EOFError(f"source ended after {done} of {nbytes} bytes")
        done += n


def remove_quietly(path: Path) -> None:
    """Unlink ``path``; a missing file is fine, another error is logged (never raised)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove partial file %s: %s", path, exc)


def make_dirs(d: Path, sync_dir: Callable[[Path], None]) -> None:
    """Create ``d`` and its missing parents one by one, ``sync_dir`` on the parent of each (a
    new directory entry is durable only once its parent is synced); racing creators are fine."""
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            continue
        sync_dir(m.parent)


def write_data(
    src: Path, dst: Path, manifest: Manifest, written: list[Path], *, check: bool, fsync: bool
) -> None:
    """Write the data object and fsync it; with ``check`` in one checked pass (raises
    :class:`ShardCorrupt` when the source does not match ``manifest``). ``dst`` is appended to
    ``written`` once created, for the caller's clean-up on failure; OSError (ENOSPC, EIO ...)
    propagates."""
    nbytes = manifest.data_nbytes
    try:
        sfd = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        if not check:
            raise
        raise ShardCorrupt(f"{src}: data object missing under a committed manifest") from None
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        written.append(dst)
        try:
            if check:
                copy_checked(
                    sfd,
                    dfd,
                    nbytes,
                    manifest.chunk_size,
                    manifest.chunk_crc32c or [],
                    manifest.crc32c or 0,
                    src_name=str(src),
                    writeback=fsync,
                )
            else:
                try:
                    copy_range(sfd, dfd, nbytes)
                except EOFError as exc:
                    raise OSError(errno.EIO, f"{src} is shorter than its manifest: {exc}") from exc
            if fsync:
                os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def copy_verified(sfd: int, src: Path, dst: Path, m: Manifest, verify: bool) -> None:
    """Copy ``m.data_nbytes`` from the open ``sfd`` (``src``) into ``dst`` (created, not
    truncated), checking every chunk's CRC32C with ``verify``. Raises :class:`ShardCorrupt`
    (mismatch), :class:`TierFull` (``dst``'s filesystem is full), :class:`TierError` otherwise."""
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise TierError(f"cannot open {dst} for writing ({exc.strerror})") from exc
    try:
        if not verify or m.crc32c is None or m.chunk_crc32c is None:
            # fetch_shard refuses a shard without checksums when verifying
            copy_range(sfd, dfd, m.data_nbytes)
            return
        copy_checked(
            sfd,
            dfd,
            m.data_nbytes,
            m.chunk_size,
            m.chunk_crc32c,
            m.crc32c,
            src_name=str(src),
            writeback=False,
        )
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            raise TierFull(f"no space left writing {dst}; free space in its tier") from exc
        raise TierError(f"copying {src} to {dst} failed: {exc}") from exc
    finally:
        os.close(dfd)
