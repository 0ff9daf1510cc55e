"""The device bench's bit-exact round trip (bench/gpu.py), run on the CPU in CI: bf16, fp32, fp8,
views sharing storage, non-contiguous tensors and a DTensor on a 1-rank gloo mesh come back
bit-identical through the Checkpointer, on CPU tensors and under the device seam's asynchronous
stand-in (the CUDA branches of save and restore)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench import gpu

from strata.client import device
from strata.client.device import StandInDevice

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _assert_every_kind(rt: dict[str, object]) -> None:
    assert rt["failures"] == [] and rt["ok"] is True
    kinds = rt["kinds"]
    assert isinstance(kinds, dict)
    want = set(gpu.KINDS) if hasattr(torch, "float8_e4m3fn") else set(gpu.KINDS) - {"fp8_e4m3fn"}
    assert set(kinds) == want and all(kinds.values()), kinds


def test_every_kind_round_trips_bit_exact_on_cpu(shm_dir: Path) -> None:
    _assert_every_kind(gpu.run_roundtrip(shm_dir, "cpu"))


def test_every_kind_round_trips_bit_exact_under_the_stand_in_device(shm_dir: Path) -> None:
    """``hold``: copies land only when a wait needs them, so a missing wait shows as torn bits."""
    dev = StandInDevice(hold=True)
    try:
        with device.use(dev):
            _assert_every_kind(gpu.run_roundtrip(shm_dir, "cpu", dev.tensor))
            assert {kind for _, kind in dev.copies} == {"d2h", "h2d"}
    finally:
        dev.close()


def test_the_round_trip_sees_bytes_that_did_not_come_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check itself: a restore that loads nothing is reported per kind, not passed."""
    from strata.client import Checkpointer

    real = Checkpointer.restore

    def restore_then_lose_bf16(self: Checkpointer, state: dict[str, torch.Tensor], step=None):  # type: ignore[no-untyped-def]
        res = real(self, state, step)
        state["bf16"].view(torch.int16)[5] ^= 1
        return res

    monkeypatch.setattr(Checkpointer, "restore", restore_then_lose_bf16)
    rt = gpu.roundtrip(shm_dir / "ram", lambda t: t, blocking=(True,))
    assert rt["ok"] is False and rt["kinds"]["bf16"] is False
    assert [k for k, v in rt["kinds"].items() if not v] == ["bf16"]


def test_cpu_smoke_mode_exits_0_and_prints_every_kind(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.gpu", "--cpu-smoke", "--shm-dir", "/dev/shm"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"ok": true' in proc.stdout and '"dtensor": true' in proc.stdout
