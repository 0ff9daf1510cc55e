"""The demo's plot renders a real PNG (matplotlib, Agg) from the run's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.testing.demo_plot import RestorePoint, plot_run

pytestmark = pytest.mark.unit


def test_plot_run_writes_a_png_with_the_kills_and_the_restores(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    curve = [(s, 4.0 / (1 + s / 50)) for s in range(1, 301)]
    segments = [curve[:135], curve[130:215], curve[200:265], curve[200:]]
    restores = [
        RestorePoint("trainer killed", "ram", 130),
        RestorePoint("node lost", "pvc", 200),
        RestorePoint("RAM and PVC lost", "gcs", 200),
    ]
    out = plot_run(tmp_path / "sub" / "demo.png", segments, [135, 215, 265], restores, curve)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 572)  # 10 x 5.2 inches at 110 dpi
