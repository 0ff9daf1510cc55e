"""Small records on a POSIX tier (PVC, RAM): conditional create by ``O_EXCL`` + ``link``.

:meth:`PosixRecords.create_record` writes the payload to a unique temporary file, ``fsync``\\ s it,
then ``link``\\ s it to the final name: ``link`` fails with ``EEXIST`` when the name exists, so of
two writers exactly one creates the record and neither ever replaces it, and a reader sees the
whole payload or no file (a crash leaves at most the temporary file, which is removed by the
next writer's cleanup of its own name only; ``gc`` of ``*.tmp-*`` names happens with the step).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from strata.errors import TierError, TierFull
from strata.tiers.durability import fsync_dir, temp_name, write_new
from strata.tiers.posix_io import FULL_ERRNOS


class PosixRecords:
    """Mixin for :class:`strata.tiers.posix.PosixTier` (needs ``root``, ``fsync``, ``name``)."""

    root: Path
    fsync: bool
    name: str

    def read_record(self, key: str) -> bytes | None:
        path = self.root / key
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierError(f"cannot read {path} ({exc.strerror}); check the mount") from exc

    def create_record(self, key: str, payload: bytes) -> bool:
        path = self.root / key
        tmp = temp_name(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_new(tmp, payload, fsync=self.fsync)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            if self.fsync:
                fsync_dir(path.parent)
            return True
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                raise TierFull(
                    f"no space left on the {self.name} tier writing {path}; nothing was created"
                ) from exc
            raise TierError(f"cannot create {path} ({exc}); nothing was created") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def delete_record(self, key: str) -> None:
        path = self.root / key
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TierError(f"cannot delete {path} ({exc.strerror})") from exc
        if self.fsync:
            with contextlib.suppress(OSError):
                fsync_dir(path.parent)

    def list_records(self, prefix: str) -> list[str]:
        d = self.root / prefix
        try:
            return sorted(e.name for e in os.scandir(d) if e.is_file() and ".tmp-" not in e.name)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TierError(f"cannot list {d} ({exc.strerror}); check the mount") from exc
