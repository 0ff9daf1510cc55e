"""`make demo` end to end: the main job must keep working (real processes, tmpfs, fake-gcs-server)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_demo_recovers_from_every_tier_bit_identically(tmp_path: Path) -> None:
    # Unique across concurrent pytest sessions (tmp_path's basename is not).
    ram = Path("/dev/shm") / f"strata-test-demo-{uuid.uuid4().hex[:12]}"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "strata.demo",
                "--workdir",
                str(tmp_path / "work"),
                "--ram-dir",
                str(ram),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        subprocess.run(["rm", "-rf", str(ram)], check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    # Recovery table rows: "<scenario...> <expected tier> <tier> <step> <seconds>".
    table = out[out.index("recovery ") :].splitlines()[1:4]
    served = {row.split()[-4]: (row.split()[-3], int(row.split()[-2])) for row in table}
    assert served == {"ram": ("ram", 130), "pvc": ("pvc", 200), "gcs": ("gcs", 200)}, out[-3000:]
    assert "final weights vs uninterrupted run: bit-identical" in out
    assert "all checks held" in out
    # The plot next to the table: a real PNG of the run.
    png = tmp_path / "work" / "demo.png"
    assert f"plot of the run (loss, kills, restores and their tiers): {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
