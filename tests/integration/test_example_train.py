"""examples/train.py, the script the example workloads run, on the real tmpfs: a run stopped at
step 25 and resumed ends with weights bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
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


def test_recipe_as_written_reaches_the_pvc(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Any
) -> None:
    """The docstring's recipe (a sidecar and one run with its own cadence; the directories moved
    under the test's) leaves the PVC steps it promises."""
    from strata.config import StrataConfig
    from strata.tiers.posix import PosixTier
    from tests.integration.test_example_fsdp import recipe

    raw, runs = recipe(TRAIN)
    assert raw["pvc"]["every"]["steps"] == 10 and runs == [["--steps", "50", "--allow-fresh-start"]]
    raw["ram"]["path"] = str(shm_dir / "ram")
    raw["pvc"]["path"] = str(tmp_path / "pvc")
    config = StrataConfig.parse(raw)
    sidecar = sidecar_proc(config, wait=False)  # metrics_port 0: no /healthz, wait for the log
    deadline = time.monotonic() + 120
    while not any(e.get("event") == "ready" for e in sidecar.log_events()):
        assert sidecar.proc.poll() is None and time.monotonic() < deadline, sidecar.logs()
        time.sleep(0.1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["STRATA_CONFIG"] = json.dumps(raw)
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *runs[0]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pvc = PosixTier(raw["pvc"]["path"], "pvc")
    # The newest step at or past 40 (the last multiple of 10 the run reached) is promoted.
    deadline = time.monotonic() + 120
    while max(pvc.list_steps(config.job_id), default=-1) < 40:
        assert time.monotonic() < deadline, (pvc.list_steps(config.job_id), sidecar.logs())
        time.sleep(0.2)
    assert len(pvc.list_steps(config.job_id)) <= 2  # keep: 2
    assert sidecar.terminate() == 0
