"""Render a results JSON as the Markdown tables of bench/README.md.

``python -m bench.report [bench/results/latest.json]`` prints: the ratios against their targets,
the median/min/max of every section, and the Young/Daly table.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.run import RESULTS


def _f(x: float, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    m = report["machine"]
    out.append(
        f"Run of {report['generated']} (git {m.get('git_commit', '?')}) on {m['cpus']} CPUs "
        f"({m['cpu']}), torch {m['torch']}, "
        f"kernel {m['kernel']}; arguments: `{' '.join(report['argv']) or '(defaults)'}`; "
        f"{report['elapsed_s']:.0f} s."
    )
    out.append("")
    out.append("| workload | bytes | tensors |")
    out.append("|---|---:|---:|")
    for name, w in report["workloads"].items():
        out.append(f"| {name}: {w['description']} | {w['bytes'] / 1e9:.3f} GB | {w['tensors']} |")
    out.append("")
    out.append("| figure (W1 unless named) | value | target | holds |")
    out.append("|---|---:|---:|:---:|")
    for key, value in report["ratios"].items():
        t = report["targets"].get(key)
        target = t["target"] if t else ""
        holds = "" if not t else {True: "yes", False: "**no**", None: "n/a"}[t["holds"]]
        out.append(f"| `{key}` | {_f(value)} | {target} | {holds} |")
    for title, sec in report["sections"].items():
        cases = sec.get("cases") if isinstance(sec, dict) else None
        if not cases:
            continue
        nbytes = sec.get("nbytes")
        out.append("")
        out.append(f"**{title}** ({sec['rounds']} rounds after {sec['warmup']} warm-up)")
        out.append("")
        out.append("| case | median s | min s | max s |" + (" GB/s |" if nbytes else ""))
        out.append("|---|---:|---:|---:|" + ("---:|" if nbytes else ""))
        for name, case in cases.items():
            st = case["stats"].get("seconds")
            if not st:
                out.append(
                    f"| {name} | error: {case.get('error')} | | |" + (" |" if nbytes else "")
                )
                continue
            row = f"| {name} | {_f(st['median'])} | {_f(st['min'])} | {_f(st['max'])} |"
            if nbytes:
                row += f" {_f(nbytes / st['median'] / 1e9) if st['median'] > 0 else 'n/a'} |"
            out.append(row)
            for key, st2 in case["stats"].items():
                if key in ("seconds", "elements"):
                    continue
                extra = " |" if nbytes else ""
                out.append(
                    f"| &nbsp;&nbsp;{name}.{key} | {_f(st2['median'])} | {_f(st2['min'])} | "
                    f"{_f(st2['max'])} |{extra}"
                )
    yd = report.get("young_daly", {})
    if yd.get("rows"):
        out.append("")
        out.append(
            "| method | cost C (s) | MTBF | optimal interval sqrt(2CM) | goodput | lost to "
            "checkpoints + rework |"
        )
        out.append("|---|---:|---:|---:|---:|---:|")
        for row in yd["rows"]:
            out.append(
                f"| {row['method']} | {_f(row['cost_s'])} | {row['mtbf_h']:g} h | "
                f"{row['interval_s']:.0f} s | {100 * row['goodput']:.2f}% | "
                f"{100 * row['lost_fraction']:.2f}% |"
            )
    for note in report.get("notes", []):
        out.append(f"\nNote: {note}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else RESULTS / "latest.json"
    print(render(json.loads(path.read_text())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
