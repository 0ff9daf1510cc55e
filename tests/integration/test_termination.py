"""Graceful termination with real processes and real signals (C-14): a trainer subprocess with a
256 MiB state on the machine's tmpfs and a real ``strata sidecar`` process; SIGTERM the trainer
as the kubelet does first, then the sidecar as it does after the trainer exited.

Each test asserts what a user relies on: the newest step saved to RAM is committed on the PVC
directory and a fresh restore (an empty RAM tier: the replacement pod) gets that step with its
bytes. The PVC interval is never due during the run, so only the termination flush can put the
step there. Variants: the loop polls ``should_stop``; a user's SIGTERM handler is chained; the
loop never polls; the trainer is PID 1 of its own PID namespace (where a process without a
handler never sees SIGTERM at all).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer
from strata.client.sidecar_client import connect
from strata.config import StrataConfig
from strata.sidecar.priority import STEADY_NICE, thread_ioprio
from strata.tiers.posix import PosixTier
from tests.fixtures.preempted import SAVE_EVERY, expected
from tests.fixtures.sidecar import REPO, SidecarProcess, free_port
from tests.fixtures.tmpfs import SHM

Start = Callable[..., SidecarProcess]
JOB = "ns.preempted"
MIB = int(os.environ.get("STRATA_TEST_TERMINATION_MIB", "256"))
"""State size; a larger one for a measurement (``STRATA_TEST_TERMINATION_MIB=1024``)."""
NUMEL = MIB * 1024 * 1024 // 4


@pytest.fixture
def ram_dirs() -> Iterator[Callable[[], Path]]:
    """Fresh directories on /dev/shm (the pod's RAM tier, and the replacement pod's)."""
    if not SHM.is_dir():
        pytest.skip("/dev/shm (tmpfs) is not available on this machine")
    made: list[Path] = []

    def make() -> Path:
        d = SHM / f"strata-term-{uuid.uuid4().hex[:12]}"
        d.mkdir()
        made.append(d)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


GRACE = float(os.environ.get("STRATA_TEST_TERMINATION_GRACE", "30"))
"""The pod's grace period (seconds) in these tests (30: what GKE spot VMs give)."""


def config_for(ram: Path, pvc: Path, grace: float = GRACE) -> StrataConfig:
    return StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(ram), "every": {"steps": SAVE_EVERY}, "keep": 1},
            # Never due in a test: only the termination flush puts a step on the PVC.
            "pvc": {"path": str(pvc), "every": {"steps": 100000}, "keep": 2},
            "metrics_port": free_port(),
            "metrics_host": "127.0.0.1",
            "writer_id": "pod-a",
            "termination_grace_seconds": grace,
        }
    )


class Trainer:
    """``python -m tests.fixtures.preempted`` beside the sidecar, optionally as PID 1."""

    def __init__(
        self,
        config: StrataConfig,
        mode: str,
        log: Path,
        pid1: bool = False,
        mib: int = MIB,
        env: dict[str, str] | None = None,
    ) -> None:
        full = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        full.update(config.to_env())
        full["PYTHONPATH"] = os.pathsep.join([str(REPO / "sidecar"), str(REPO)])
        full.update(env or {})
        env = full
        self.log = log
        cmd = [sys.executable, "-m", "tests.fixtures.preempted", mode, str(log), str(mib)]
        if pid1:
            cmd = ["unshare", "--pid", "--fork", *cmd]
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO)
        self.pid1 = pid1

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def saved(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines() if line.startswith("saved ")]

    def wait_saved(self, count: int, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.saved()) < count:
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited with {self.proc.returncode}: {self.lines()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trainer saved {self.saved()} within {timeout}s")
            time.sleep(0.1)

    def trainer_pid(self) -> int:
        """The trainer's own pid (the child of ``unshare`` when it is PID 1 of a namespace)."""
        if not self.pid1:
            return self.proc.pid
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            kids = children.read_text().split()
            if kids:
                return int(kids[0])
            time.sleep(0.05)
        raise AssertionError("unshare started no child")

    def terminate(self, timeout: float) -> tuple[int, float]:
        """SIGTERM the trainer (as the kubelet does); its exit status and seconds to exit."""
        pid = self.trainer_pid()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        code = self.proc.wait(timeout)
        return code, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def trainers() -> Iterator[Callable[..., Trainer]]:
    made: list[Trainer] = []

    def start(*args: Any, **kwargs: Any) -> Trainer:
        t = Trainer(*args, **kwargs)
        made.append(t)
        return t

    yield start
    for t in made:
        t.kill()


def restore_fresh(ram: Path, pvc: Path) -> tuple[int | None, str | None, torch.Tensor]:
    """What the replacement pod restores: an empty RAM tier, the same PVC."""
    state: dict[str, Any] = {"w": torch.zeros(NUMEL, dtype=torch.int32), "step": -1}
    with Checkpointer(
        job_id=JOB, ram_dir=ram, pvc_dir=pvc, rank=0, world_size=1, keep=1, allow_fresh_start=True
    ) as ckpt:
        result = ckpt.restore(state)
    return result.step, result.tier, state["w"]


def run_and_terminate(
    tmp_path: Path,
    ram_dirs: Callable[[], Path],
    sidecar_proc: Start,
    trainers: Callable[..., Trainer],
    mode: str,
    pid1: bool = False,
    status: list[dict[str, Any] | None] | None = None,
) -> tuple[Trainer, int, SidecarProcess, Path]:
    pvc = tmp_path / "pvc"
    config = config_for(ram_dirs(), pvc)
    side = sidecar_proc(config)
    trainer = trainers(config, mode, tmp_path / "trainer.log", pid1=pid1)
    trainer.wait_saved(2)
    t0 = time.monotonic()
    code, seconds = trainer.terminate(timeout=config.termination_grace_seconds)
    # The trainer's notice alone starts the flush: the step is durable before the sidecar gets
    # its own SIGTERM (a native sidecar gets it only after the trainer exited).
    wait_until(
        lambda: max(PosixTier(pvc).complete_steps(JOB), default=-1) >= max(trainer.saved()),
        timeout=config.termination_grace_seconds,
        what=f"the newest saved step on the PVC before the sidecar's SIGTERM:\n{side.logs()}",
    )
    durable = time.monotonic() - t0
    print(
        f"{mode}{' pid1' if pid1 else ''}: trainer exit {code} {seconds:.2f}s, newest step "
        f"durable {durable:.2f}s after SIGTERM ({MIB} MiB)"
    )
    if status is not None:
        api = connect(config.socket)
        assert api is not None
        status.append(api.status().flush_estimate)
    assert side.terminate(timeout=config.termination_grace_seconds) == 0, side.logs()
    for e in side.log_events():
        if e.get("event") == "flush":
            print(
                f"  flush pass: step {e['step']} {e['bytes']} bytes {e['seconds']}s fit {e['fit']}"
            )
    return trainer, code, side, pvc


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def assert_restores(ram_dirs: Callable[[], Path], pvc: Path, step: int) -> None:
    assert step in PosixTier(pvc).complete_steps(JOB)
    restored, tier, w = restore_fresh(ram_dirs(), pvc)
    assert (restored, tier) == (step, "pvc")
    assert torch.equal(w, expected(step, NUMEL))


def test_sigterm_with_should_stop_saves_the_current_step_and_makes_it_durable_before_exit(
    tmp_path: Path,
    ram_dirs: Callable[[], Path],
    sidecar_proc: Start,
    trainers: Callable[..., Trainer],
) -> None:
    estimates: list[dict[str, Any] | None] = []
    trainer, code, side, pvc = run_and_terminate(
        tmp_path, ram_dirs, sidecar_proc, trainers, "poll", status=estimates
    )
    assert code == 128 + signal.SIGTERM
    final = [line.split() for line in trainer.lines() if line.startswith("final ")]
    assert len(final) == 1, trainer.lines()
    step, durable, fit = int(final[0][1]), final[0][2], final[0][3]
    # The final save is the step the loop was at, newer than the last periodic save, and the
    # trainer exited only after the sidecar confirmed it durable within the grace period.
    assert step > max(trainer.saved())
    assert (int(durable), fit) == (step, "True")
    assert_restores(ram_dirs, pvc, step)
    notices = [e for e in side.log_events() if e.get("event") == "termination_notice"]
    assert notices and notices[0]["source"] == "trainer"
    # The flush measured itself: the estimate the operator gets covers the state and fits.
    estimate = estimates[0]
    assert estimate is not None
    assert estimate["tier"] == "pvc" and estimate["state_bytes"] >= MIB * 1024 * 1024
    assert estimate["fits"] is True and estimate["last_ok"] is True
    assert estimate["last_step"] == step and estimate["budget_seconds"] == GRACE - 5.0


def test_a_users_sigterm_handler_is_chained_and_the_flush_still_happens(
    tmp_path: Path,
    ram_dirs: Callable[[], Path],
    sidecar_proc: Start,
    trainers: Callable[..., Trainer],
) -> None:
    trainer, code, _side, pvc = run_and_terminate(
        tmp_path, ram_dirs, sidecar_proc, trainers, "user-handler"
    )
    assert code == 128 + signal.SIGTERM
    assert "user-handler" in trainer.lines()
    final = [line.split() for line in trainer.lines() if line.startswith("final ")]
    assert len(final) == 1, trainer.lines()
    assert_restores(ram_dirs, pvc, int(final[0][1]))


def test_a_trainer_that_never_polls_still_gets_its_newest_committed_step_flushed(
    tmp_path: Path,
    ram_dirs: Callable[[], Path],
    sidecar_proc: Start,
    trainers: Callable[..., Trainer],
) -> None:
    trainer, code, side, pvc = run_and_terminate(
        tmp_path, ram_dirs, sidecar_proc, trainers, "ignore"
    )
    # Strata's handler ended the process (SIGTERM's default action) after the notice.
    assert code == 128 + signal.SIGTERM
    newest = max(PosixTier(pvc).complete_steps(JOB))
    # A save may commit between its `saved` line and the signal: at least the last one logged.
    assert newest >= max(trainer.saved())
    assert newest % SAVE_EVERY == 0
    assert_restores(ram_dirs, pvc, newest)
    notices = [e for e in side.log_events() if e.get("event") == "termination_notice"]
    assert notices and notices[0]["source"] == "trainer"


def test_a_trainer_as_pid_1_of_its_pid_namespace_reacts_to_sigterm(
    tmp_path: Path,
    ram_dirs: Callable[[], Path],
    sidecar_proc: Start,
    trainers: Callable[..., Trainer],
) -> None:
    """The container case of a real node: PID 1 gets only the signals it handles."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare(1) and root for a PID namespace")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    trainer, code, _side, pvc = run_and_terminate(
        tmp_path, ram_dirs, sidecar_proc, trainers, "ignore", pid1=True
    )
    assert code == 128 + signal.SIGTERM
    newest = max(PosixTier(pvc).complete_steps(JOB))
    assert newest >= max(trainer.saved())
    assert_restores(ram_dirs, pvc, newest)


def _thread_nice(pid: int) -> dict[int, int]:
    """{tid: nice} of every thread of process ``pid`` (field 19 of proc_pid_stat(5))."""
    nice = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            nice[int(task.name)] = int(fields[16])
    return nice


def _new_threads(pid: int, before: set[int], what: str) -> dict[int, int]:
    """{tid: nice} of the threads of ``pid`` that were not in ``before``, once there is one."""
    wait_until(lambda: bool(set(_thread_nice(pid)) - before), 30, what)
    return {t: n for t, n in _thread_nice(pid).items() if t not in before}


def test_the_sidecar_keeps_its_main_thread_at_normal_priority_and_lowers_promotion_threads(
    tmp_path: Path, ram_dirs: Callable[[], Path], sidecar_proc: Start
) -> None:
    """Start-up, the readiness probe, the local API and the termination flush run at the pod's
    priority; only steady-state promotion is polite (nice 19, I/O best-effort 7).

    The thread that answers a probe is caught in the act: a request left unfinished on the
    socket keeps its handler thread (started by the server on accept) waiting for the rest."""
    config = config_for(ram_dirs(), tmp_path / "pvc")
    side = sidecar_proc(config)
    pid = side.proc.pid
    base = os.getpriority(os.PRIO_PROCESS, 0)
    polite = 2 << 13 | 7  # ioprio_set(2): class best-effort (2), level 7
    # The promotion loop lowers itself first thing (it starts just after readiness).
    wait_until(
        lambda: any(
            n == STEADY_NICE and thread_ioprio(t) in (None, polite)
            for t, n in _thread_nice(pid).items()
        ),
        30,
        "the promotion thread at nice 19",
    )
    nice = _thread_nice(pid)
    assert nice[pid] == base
    promotion = {t for t, n in nice.items() if n == STEADY_NICE}
    assert sum(1 for n in nice.values() if n == base) >= 3, nice  # main + the two servers

    # The readiness probe: /healthz on the metrics port, answered in a thread of its own.
    before = set(_thread_nice(pid))
    with socket.create_connection(("127.0.0.1", config.metrics_port), timeout=10) as probe:
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        handler = _new_threads(pid, before, "a thread answering the probe")
        assert set(handler.values()) == {base}, handler
        assert all(thread_ioprio(t) != polite for t in handler)
        probe.sendall(b"Connection: close\r\n\r\n")
        assert probe.recv(64).split(b" ")[1] == b"200"

    # The termination flush: a notice announcing a final save holds the flush thread for a
    # few seconds (HOLD_MAX_SECONDS), long enough to read its priority.
    client = connect(config.socket)
    assert client is not None
    before = set(_thread_nice(pid))
    reply = client.terminate(JOB, 0, since_signal_seconds=0.0, final_save=True)
    assert reply.started
    flush = _new_threads(pid, before, "the termination flush thread")
    assert set(flush.values()) == {base}, flush
    assert all(thread_ioprio(t) != polite for t in flush)
    # and nothing the notice started lowered anyone else
    assert {t for t, n in _thread_nice(pid).items() if n == STEADY_NICE} <= promotion
