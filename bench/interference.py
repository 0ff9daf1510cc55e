"""Background interference: how much a compute-bound training step slows while promotion runs.

The "training step" is a fixed number of fp32 matmuls calibrated to ~100 ms. Windows of steps
alternate between quiet (nothing else running) and busy (a separate process promotes the
committed RAM shard to the PVC directory in a loop, exactly as the sidecar does), round-robin.
The figure is ``median(busy step) / median(quiet step) - 1``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch


class StepLoop:
    """A compute-bound step: ``reps`` matmuls of ``n x n`` fp32 with ``threads`` torch threads."""

    def __init__(self, threads: int, target_s: float = 0.1, n: int = 512) -> None:
        self.threads = threads
        gen = torch.Generator().manual_seed(7)
        self.a = torch.rand((n, n), generator=gen)
        self.b = torch.rand((n, n), generator=gen)
        self.reps = 1
        with _threads(threads):
            for _ in range(3):
                self._step()
            one = min(self._timed() for _ in range(5))
        self.reps = max(1, round(target_s / one))

    def _step(self) -> None:
        c = self.a
        for _ in range(self.reps):
            c = torch.mm(self.b, self.a)
        float(c[0, 0])

    def _timed(self) -> float:
        t0 = time.perf_counter()
        self._step()
        return time.perf_counter() - t0

    def run(self, steps: int) -> list[float]:
        with _threads(self.threads):
            return [self._timed() for _ in range(steps)]


class _threads:
    def __init__(self, n: int) -> None:
        self.n = n
        self.prev = torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.prev)


class Background:
    """A promoter process (``python -m bench.promoter``) running for the duration of a window."""

    def __init__(self, args: list[str], ready_file: Path) -> None:
        self.args = args
        self.ready_file = ready_file
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Background:
        self.ready_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.promoter", "--ready", str(self.ready_file), *self.args],
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        deadline = time.monotonic() + 60
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"promoter exited early with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("promoter did not start within 60 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        rounds_file = self.ready_file.with_suffix(".count")
        self.promotions = int(rounds_file.read_text()) if rounds_file.exists() else 0
        if self.proc.returncode != 0:  # it exits 0 on SIGTERM; else the window measured nothing
            raise RuntimeError(
                f"promoter failed (status {self.proc.returncode}) after {self.promotions} "
                "promotions: this window ran without it"
            )
