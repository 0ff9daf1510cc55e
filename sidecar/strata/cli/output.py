"""Output of the ``strata`` subcommands: rich tables for people, JSON for scripts, progress bars.

Every subcommand builds plain rows (dicts of builtins) and hands them to :func:`emit`: ``-o json``
prints them as one JSON document on stdout; ``-o table`` renders a table. Progress bars go to
stderr and only when it is a terminal (scripts and logs get none).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= div:
            return f"{s // div}{unit}"
    return f"{s}s"


def age_of(timestamp: float | str | None) -> float | None:
    """Seconds since ``timestamp`` (epoch seconds or RFC 3339); None for None."""
    if isinstance(timestamp, str):
        timestamp = datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    return None if timestamp is None else time.time() - timestamp


def rfc3339(timestamp: float) -> str:
    """Epoch seconds as RFC 3339 in UTC with milliseconds: ``2026-12-02T15:11:12.345+00:00``."""
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds")


def stdout() -> Console:
    return Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)


def emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False, default=str))


def table(
    title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]], console: Console
) -> None:
    t = Table(title=title, title_justify="left", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("-" if v is None else str(v) for v in r))
    console.print(t)


class Advance(Protocol):
    def __call__(self, nbytes: int, what: str = "") -> None: ...


@contextmanager
def progress(total_bytes: int, label: str, enabled: bool) -> Iterator[Advance]:
    """A byte progress bar on stderr (only on a terminal and when ``enabled``); yields
    ``advance(nbytes, what)``."""
    err = Console(stderr=True)
    if not enabled or not err.is_terminal:

        def quiet(nbytes: int, what: str = "") -> None:
            return None

        yield quiet
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total_bytes)

        def advance(nbytes: int, what: str = "") -> None:
            bar.update(task, advance=nbytes, description=f"{label} {what}".strip())

        yield advance
