"""The demo's plot: the loss curve of every trainer process of the run, where each was killed,
and where and from which tier each restore resumed (a PNG next to the printed table).

matplotlib (the ``dev`` extra) renders it headless (Agg). Pure input: lists of numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TIER_COLOURS = {"ram": "#2ca02c", "pvc": "#1f77b4", "gcs": "#9467bd"}


@dataclass(frozen=True)
class RestorePoint:
    """A trainer process that restored ``step`` from ``tier`` after ``scenario``."""

    scenario: str
    tier: str | None
    step: int | None


def plot_run(
    path: Path,
    segments: Sequence[Sequence[tuple[int, float]]],
    kills: Sequence[int],
    restores: Sequence[RestorePoint],
    reference: Sequence[tuple[int, float]] = (),
    title: str = "Strata demo: training loss through three failures",
) -> Path:
    """Write the PNG to ``path`` and return it.

    ``segments``: per trainer process, its (step, loss) pairs in order; ``kills``: the step at
    which each killed process was stopped; ``restores``: the restore each later process made
    (in order); ``reference``: (step, loss) of the uninterrupted run, drawn underneath.
    Raises ImportError when matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    if reference:
        xs, ys = zip(*reference, strict=True)
        ax.plot(xs, ys, color="#bbbbbb", lw=4, label="uninterrupted run (reference)", zorder=1)
    for i, seg in enumerate(segments):
        if not seg:
            continue
        xs, ys = zip(*seg, strict=True)
        ax.plot(xs, ys, lw=1.2, label=f"trainer process {i + 1}", zorder=2)
    ax.set_yscale("log")
    bottom, top = ax.get_ylim()
    for k in kills:
        ax.axvline(k, color="#d62728", ls="--", lw=1, zorder=3)
        ax.annotate(
            f"SIGKILL at step {k}",
            (k, bottom),
            xytext=(3, 4),
            textcoords="offset points",
            color="#d62728",
            fontsize=8,
            rotation=90,
            va="bottom",
        )
    losses = {s: loss for seg in segments for s, loss in seg}
    for i, r in enumerate(restores):
        if r.step is None:
            continue
        colour = TIER_COLOURS.get(r.tier or "", "black")
        y = losses.get(r.step + 1, losses.get(r.step, top))
        ax.scatter([r.step], [y], s=70, color=colour, edgecolor="black", zorder=4)
        ax.annotate(
            f"restored step {r.step}\nfrom {r.tier}\n({r.scenario})",
            (r.step, y),
            xytext=(-12, 30 + 42 * i),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color=colour,
            arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.8},
        )
    ax.set_yscale("log")  # the first steps' loss is orders of magnitude above the rest
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (cross-entropy, log scale)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
