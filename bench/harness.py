"""Round-robin timing: every case of a group runs once per round, after an unrecorded warm-up.

Running the cases interleaved (rather than case A five times, then case B five times) spreads
slow drifts of the machine (page cache, other processes, thermal) evenly over the cases, so the
ratios between them stay meaningful on a shared two-core machine. The order is rotated every
round so that no case always runs right after the same neighbour.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Measure = dict[str, float]
"""What one run of a case reports: at least ``seconds``; extra keys are secondary figures."""


@dataclass
class Case:
    """One thing to time. ``run`` returns the measured figures (``seconds`` is the primary one).

    ``setup`` and ``teardown`` run before/after every run, untimed (e.g. delete the previous
    output so every write is a fresh one, and keep /dev/shm from filling up).
    """

    name: str
    run: Callable[[], Measure]
    setup: Callable[[], None] | None = None
    teardown: Callable[[], None] | None = None
    label: str = ""


@dataclass
class Result:
    name: str
    label: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None

    def stats(self, key: str = "seconds") -> dict[str, float]:
        xs = self.samples.get(key, [])
        if not xs:
            return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
        return {
            "median": statistics.median(xs),
            "min": min(xs),
            "max": max(xs),
            "n": len(xs),
        }

    def median(self, key: str = "seconds") -> float:
        return self.stats(key)["median"]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "error": self.error,
            "samples": self.samples,
            "stats": {k: self.stats(k) for k in self.samples},
        }


def timed(fn: Callable[[], Any]) -> Measure:
    """Time ``fn()`` with a monotonic clock; returns ``{"seconds": ...}``."""
    t0 = time.perf_counter()
    fn()
    return {"seconds": time.perf_counter() - t0}


def run_round_robin(
    cases: list[Case],
    rounds: int,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
) -> dict[str, Result]:
    """Run every case ``warmup`` times unrecorded, then ``rounds`` recorded rounds, interleaved.

    A case that raises is recorded with its error and dropped from the following rounds (the
    others go on), so one broken baseline does not hide the rest of the table.
    """
    results = {c.name: Result(c.name, c.label or c.name) for c in cases}
    live = list(cases)
    for r in range(warmup + rounds):
        recording = r >= warmup
        shift = r % len(live) if live else 0
        order = live[shift:] + live[:shift]
        for case in order:
            res = results[case.name]
            if res.error is not None:
                continue
            try:
                if case.setup:
                    case.setup()
                gc.collect()
                m = case.run()
                if case.teardown:
                    case.teardown()
            except Exception as exc:  # a broken case is reported, not fatal
                res.error = f"{type(exc).__name__}: {exc}"
                if log:
                    log(f"  ! {case.name}: {res.error}")
                continue
            if recording:
                for k, v in m.items():
                    res.samples.setdefault(k, []).append(float(v))
        if log:
            tag = "warm-up" if not recording else f"round {r - warmup + 1}/{rounds}"
            done = ", ".join(
                f"{c.name}={results[c.name].samples.get('seconds', [math.nan])[-1]:.3f}s"
                for c in order
                if results[c.name].error is None and recording
            )
            log(f"  {tag}" + (f": {done}" if done else ""))
    return results


def format_table(title: str, results: dict[str, Result], nbytes: int | None = None) -> str:
    """A fixed-width median/min/max table (seconds, and GB/s when ``nbytes`` is given)."""
    head = f"{'case':<34} {'median s':>10} {'min s':>10} {'max s':>10}"
    if nbytes:
        head += f" {'GB/s':>8}"
    lines = [title, head, "-" * len(head)]
    for res in results.values():
        if res.error is not None and not res.samples:
            lines.append(f"{res.name:<34} {'error: ' + res.error[:60]}")
            continue
        st = res.stats()
        row = f"{res.name:<34} {st['median']:>10.4f} {st['min']:>10.4f} {st['max']:>10.4f}"
        if nbytes and st["median"] > 0:
            row += f" {nbytes / st['median'] / 1e9:>8.2f}"
        lines.append(row)
        for key in sorted(k for k in res.samples if k != "seconds"):
            s2 = res.stats(key)
            lines.append(
                f"  {'.' + key:<32} {s2['median']:>10.4f} {s2['min']:>10.4f} {s2['max']:>10.4f}"
            )
    return "\n".join(lines)


# ---- memory ----------------------------------------------------------------------------------


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    return _status_kb("VmRSS")


def rss_anon_bytes() -> int:
    return _status_kb("RssAnon")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _status_kb("VmHWM")


def tree_allocated_bytes(path: str) -> int:
    """Bytes allocated (st_blocks) under ``path``, each inode counted once (hard links)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total
