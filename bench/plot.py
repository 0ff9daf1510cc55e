"""The PNG next to latest.json: W1 save times (median, min-max bars) and the ratios vs targets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    save = next((v for k, v in report["sections"].items() if k.startswith("save W1")), None)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [1.1, 1]})
    if save:
        names, med, lo, hi = [], [], [], []
        for name, case in save["cases"].items():
            st = case["stats"].get("seconds")
            if not st or not math.isfinite(st["median"]):
                continue
            names.append(name)
            med.append(st["median"])
            lo.append(st["median"] - st["min"])
            hi.append(st["max"] - st["median"])
        colors = [
            "tab:green"
            if n.startswith("strata")
            else "tab:gray"
            if n.startswith(("memcpy", "torch_copy"))
            else "tab:red"
            for n in names
        ]
        ax1.barh(names, med, xerr=[lo, hi], color=colors, capsize=3)
        ax1.invert_yaxis()
        ax1.set_xscale("log")
        gb = (save.get("nbytes") or 0) / 1e9
        ax1.set_xlabel("seconds training blocks (log; median, bars = min..max)")
        ax1.set_title(f"save of W1 ({gb:.2f} GB): stall per method")
    keys, vals, ok = [], [], []
    for key, t in report["targets"].items():
        v = t["value"]
        if v is None or not math.isfinite(v):
            continue
        bound = float(t["target"].split()[1])
        # Normalise so that 1.0 is the target and smaller is better for every figure.
        if t["target"].startswith("<="):
            norm = max(v, 0.01 * bound) / bound
        else:
            norm = bound / v if v > 0 else math.inf
        keys.append(f"{key}\n{v:.3g} (target {t['target']})")
        vals.append(norm)
        ok.append(t["holds"])
    ax2.barh(keys, vals, color=["tab:green" if o else "tab:red" for o in ok])
    ax2.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax2.set_xscale("log")
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=7)
    ax2.set_xlabel("figure / target, log (<= 1 meets the target)")
    ax2.set_title("ratios measured side by side")
    m = report.get("machine", {})
    fig.suptitle(
        f"Strata bench {report.get('generated', '')} - {m.get('cpus')} CPUs, {m.get('cpu')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.plot RESULTS.json OUT.png``: redraw a plot from a results file."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    plot(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
