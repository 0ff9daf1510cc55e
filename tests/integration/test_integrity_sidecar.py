"""Issue 11, failures 4 and 7: the sidecar going away during a restore, and SIGTERM reaching
the sidecar whichever thread the kernel delivers it to (real sidecar processes)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer
from strata.tiers.posix import PosixTier
from tests.fixtures.sidecar import SidecarProcess
from tests.integration.test_sidecar import JOB, config_for, wait_until

pytestmark = pytest.mark.integration
Start = Callable[..., SidecarProcess]


def state_for(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32 * 1024, generator=g), "step": step}


def test_failure4_sidecar_killed_before_the_restore_inventory(
    shm_dir: Path, sidecar_proc: Start
) -> None:
    config = config_for(shm_dir)
    side = sidecar_proc(config)
    with Checkpointer(config, rank=0, world_size=1) as c:
        assert c.save(10, state_for(10))
        c.wait()
        side.kill()  # the sidecar container dies; the trainer restores
        target = state_for(0)
        res = c.restore(target)
    assert res.step == 10 and res.tier == "ram"
    assert torch.equal(target["w"], state_for(10)["w"])  # type: ignore[arg-type]
    assert any(n.startswith("sidecar: stopped answering") for n in res.skipped), res.skipped


def test_failure4_sidecar_killed_while_staging_from_the_pvc(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """The sidecar dies in the middle of staging (after copying the shard into a RAM slot,
    before committing it there): the trainer stages the shard itself from the PVC. (A PVC copy
    is loaded where it lies by default, without staging: ``restore.load_in_place`` off.)"""
    pvc = tmp_path / "pvc"
    config = config_for(shm_dir, pvc)
    config = config.model_copy(
        update={"restore": config.restore.model_copy(update={"load_in_place": False})}
    )
    side = sidecar_proc(config)
    with Checkpointer(config, rank=0, world_size=1) as c:
        assert c.save(50, state_for(50))
        c.wait()
        wait_until(lambda: 50 in PosixTier(pvc).complete_steps(JOB), what="step 50 on the PVC")
    side.kill()
    subprocess.run(["rm", "-rf", str(shm_dir / JOB)], check=True)  # a recreated pod
    side = sidecar_proc(config, STRATA_FAULT="stage.copied=kill")
    with Checkpointer(config, rank=0, world_size=1) as c:
        target = state_for(0)
        res = c.restore(target)
    assert side.proc.wait(30) == -signal.SIGKILL  # it died at the injected point
    assert res.step == 50 and res.tier == "pvc"
    assert torch.equal(target["w"], state_for(50)["w"])  # type: ignore[arg-type]
    assert any(n.startswith("sidecar: stopped answering") for n in res.skipped), res.skipped


def _tgkill(pid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(234, pid, tid, sig) != 0:  # SYS_tgkill on x86_64
        raise OSError(ctypes.get_errno(), "tgkill")


def test_failure7_sigterm_delivered_to_another_thread_still_stops_the_sidecar(
    shm_dir: Path, sidecar_proc: Start
) -> None:
    """The kernel may deliver a process-directed SIGTERM to any thread; the old main loop
    parked in an untimed Event.wait() never ran the handler and the sidecar never exited."""
    side = sidecar_proc(config_for(shm_dir))
    pid = side.proc.pid
    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the sidecar runs background threads"
    _tgkill(pid, tids[-1], signal.SIGTERM)
    assert side.proc.wait(120) == 0
    assert any(e.get("event") == "signal" for e in side.log_events())
