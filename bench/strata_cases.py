"""Strata's side of every comparison, through its public client and tier APIs only."""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.harness import Measure

JOB = "bench.strata"


def unavailable() -> str | None:
    """None when Strata's client and tiers import; else why not (the case is reported as missing)."""
    try:
        import strata.client
        import strata.tiers.posix  # noqa: F401
    except Exception as exc:  # any import problem means "not measurable", reported as such
        return f"{type(exc).__name__}: {exc}"
    return None


def gcs_unavailable() -> str | None:
    try:
        import strata.emulator
        import strata.tiers.gcs  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return unavailable()


class StrataSaver:
    """A Strata client on a RAM tier directory of its own."""

    def __init__(self, ram_dir: Path, threads: int) -> None:
        raise NotImplementedError

    slots: int = 0
    ram_dir: Path

    def save(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def wait_committed(self) -> None:
        raise NotImplementedError

    def committed_shard(self) -> tuple[Path, Path]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def promote_once(src_data: Path, src_manifest: Path | None, dst_root: Path) -> None:
    raise NotImplementedError


def restore_ram(saver: StrataSaver, state: dict[str, Any]) -> Measure:
    raise NotImplementedError


def restore_from_dir(pvc_root: Path, saver: StrataSaver, state: dict[str, Any]) -> Measure:
    raise NotImplementedError


class GcsBench:
    def __init__(self, dl_dir: Path) -> None:
        self.dl_dir = dl_dir

    def __enter__(self) -> GcsBench:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def clear(self) -> None: ...
    def clear_dl(self) -> None: ...

    def plain_upload(self, src: Path) -> Measure:
        t0 = time.perf_counter()
        return {"seconds": time.perf_counter() - t0}

    tm_upload = plain_upload
    strata_put = plain_upload
