"""Tier locations given on the command line: ``ram:DIR``, ``pvc:DIR``, a plain ``DIR``, or
``gs://BUCKET[/PREFIX]``, opened as :class:`strata.tiers.base.Tier` objects.

A plain directory is the RAM tier when it holds a RAM slot ring (``<job>/slots/``), else a PVC
tier; ``ram:``/``pvc:`` say it explicitly (it matters to ``strata plan``: a RAM tier serves only
the ranks of its own node). ``gs://`` uses the usual Google credentials (Application Default
Credentials, ``GOOGLE_APPLICATION_CREDENTIALS``) or ``STORAGE_EMULATOR_HOST`` for an emulator.
Nothing here writes to a tier.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from strata.config import TierName
from strata.errors import StrataError
from strata.tiers.base import Tier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier

CLI_WRITER_ID = "strata-cli"
"""Writer id of the tiers the CLI opens (it never writes; GCS needs one)."""


class UsageError(StrataError):
    """Bad command-line input (exit status 2); the message says what to pass instead."""


class NotFound(StrataError):
    """No such job / step / nothing restorable (exit status 3)."""


@dataclass
class Location:
    """One tier location as given (``spec``) and the tier opened on it."""

    spec: str
    tier: Tier

    @property
    def kind(self) -> TierName:
        return self.tier.name

    def jobs(self) -> list[str]:
        """Job ids with a ``steps/`` directory (or prefix) in this location, sorted."""
        return self.tier.list_jobs()


def open_location(spec: str) -> Location:
    """Open ``spec`` (see the module docstring). Raises :class:`UsageError` for a missing
    directory or a malformed ``gs://`` URL, :class:`TierError` when GCS has no credentials."""
    if spec.startswith("gs://"):
        from strata.config import GcsTierConfig
        from strata.tiers.gcs import GcsTier

        bucket, _, prefix = spec[len("gs://") :].partition("/")
        if len(bucket) < 3:
            raise UsageError(f"{spec!r}: expected gs://BUCKET[/PREFIX]")
        config = GcsTierConfig(bucket=bucket, prefix=prefix.strip("/"))
        return Location(spec, GcsTier(config, writer_id=CLI_WRITER_ID, retry_timeout=30.0))
    kind: str | None = None
    path_s = spec
    for k in ("ram", "pvc"):
        if spec.startswith(f"{k}:"):
            kind, path_s = k, spec[len(k) + 1 :]
    path = Path(path_s).expanduser()
    if not path.is_dir():
        raise UsageError(
            f"{spec!r}: no such directory; pass a RAM or PVC tier directory (the one mounted at "
            "STRATA_RAM_DIR / STRATA_PVC_DIR) or gs://BUCKET/PREFIX"
        )
    if kind is None:
        kind = "ram" if _has_slots(path) else "pvc"
    tier: Tier = RamTier(path) if kind == "ram" else PosixTier(path, "pvc", fsync=False)
    return Location(spec, tier)


def _has_slots(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any((Path(e.path) / "slots").is_dir() for e in it if e.is_dir())
    except OSError:
        return False


@contextmanager
def opened(specs: Sequence[str]) -> Iterator[list[Location]]:
    """Open every location; close them (GCS connections) on exit."""
    if not specs:
        raise UsageError("give at least one tier location (a directory or gs://BUCKET/PREFIX)")
    with ExitStack() as stack:
        out = []
        for spec in specs:
            loc = open_location(spec)
            stack.callback(loc.tier.close)
            out.append(loc)
        yield out


def jobs_in(locations: Sequence[Location], job: str | None) -> list[str]:
    """``[job]`` when given, else every job found in any location (sorted)."""
    if job is not None:
        return [job]
    found: set[str] = set()
    for loc in locations:
        found.update(loc.jobs())
    return sorted(found)
