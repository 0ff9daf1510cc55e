"""examples/train.py, the script the example workloads run, on the real tmpfs: a run stopped at
step 25 and resumed ends with weights bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"strata-example-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def train(ram: Path, pvc: Path, job: str, *args: str) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "STRATA_JOB_ID": job,
        "STRATA_RAM_DIR": str(ram),
        "STRATA_PVC_DIR": str(pvc),
    }
    env.pop("STRATA_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--batch", "8", "--log-every", "5", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def event(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [e for e in events if e["event"] == name]
    return found


def test_resumed_example_run_is_bit_identical(shm_dir: Path, tmp_path: Path) -> None:
    straight = train(
        shm_dir / "a", tmp_path / "a", "ex.straight", "--steps", "40", "--allow-fresh-start"
    )
    assert event(straight, "restored")["step"] is None  # fresh start, said so

    first = train(
        shm_dir / "b", tmp_path / "b", "ex.resumed", "--steps", "25", "--allow-fresh-start"
    )
    assert event(first, "done")["steps"] == 25
    resumed = train(shm_dir / "b", tmp_path / "b", "ex.resumed", "--steps", "40")
    restored = event(resumed, "restored")
    assert (restored["step"], restored["tier"]) == (24, "ram")
    assert event(resumed, "done")["weights_sha256"] == event(straight, "done")["weights_sha256"]


def test_without_a_checkpoint_or_permission_to_start_fresh_it_refuses(
    shm_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "STRATA_JOB_ID": "ex.none", "STRATA_RAM_DIR": str(shm_dir / "c")}
    env.pop("STRATA_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert "no restorable checkpoint" in proc.stderr and "allowFreshStart" in proc.stderr
