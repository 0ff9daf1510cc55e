"""A sidecar that starts after the trainer: the Checkpointer keeps looking for it, says when it
answers, and the steps saved before and after are promoted (a real ``strata sidecar`` process)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer
from strata.client.late_sidecar import SidecarWatch
from strata.config import StrataConfig
from strata.tiers.posix import PosixTier
from tests.fixtures.sidecar import SidecarProcess

pytestmark = pytest.mark.integration
JOB = "ns.late"


def _config(shm_dir: Path, tmp_path: Path) -> StrataConfig:
    return StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(shm_dir / "ram"), "keep": 2},
            "pvc": {"path": str(tmp_path / "pvc"), "every": {"steps": 1}},
            "metrics_port": 0,
        }
    )


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.2)


def test_a_late_sidecar_is_found_and_promotes_the_steps(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    config = _config(shm_dir, tmp_path)
    caplog.set_level(logging.WARNING, logger="strata.client")
    with Checkpointer(config, rank=0, world_size=1) as c:
        watch = c._sidecar_watch
        assert watch is not None and not watch.found.is_set()
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        assert c.save(0, state)
        c.wait()
        sidecar_proc(config, wait=False)  # starts now, after the trainer
        assert watch.found.wait(timeout=120), "the Checkpointer did not find the late sidecar"
        assert any("a sidecar answers on" in r.getMessage() for r in caplog.records)
        # The steps saved from now on are promoted (the sidecar does not promote a step that was
        # already in RAM when it started, except on its SIGTERM flush).
        pvc = PosixTier(tmp_path / "pvc")
        state["w"] += 1
        assert c.save(1, state)
        c.wait()
        _wait_for(lambda: 1 in pvc.complete_steps(JOB), "step 1 on the PVC")


def test_the_watch_warns_once_after_its_grace_and_keeps_looking(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    config = _config(shm_dir, tmp_path)
    caplog.set_level(logging.WARNING, logger="strata.client")
    watch = SidecarWatch(config.socket, "pvc", grace_seconds=0, poll_seconds=0.2)
    try:
        _wait_for(lambda: watch.warned, "the warning")
        assert not watch.found.is_set()
        sidecar_proc(config, wait=False)
        assert watch.found.wait(timeout=120)
    finally:
        watch.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("NOT promoted to pvc until one does (still looking)" in m for m in messages) == 1
    assert sum("a sidecar answers on" in m for m in messages) == 1


def test_the_watch_refuses_bad_intervals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="poll_seconds"):
        SidecarWatch(tmp_path / "s.sock", "pvc", poll_seconds=0)
