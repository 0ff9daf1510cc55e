"""bench/gpu.py on a machine without a GPU: its command line and its skip (issue 14)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench import gpu

REPO = Path(__file__).resolve().parents[2]


def test_arguments_and_their_defaults() -> None:
    args = gpu.parse_args(["--gb", "8.5", "--rounds", "3", "--out", "/tmp/x", "--skip-dcp"])
    assert args.gb == 8.5 and args.rounds == 3 and args.tensors == 147
    assert args.out == Path("/tmp/x") and args.skip_dcp and not args.require_gpu
    assert gpu.parse_args([]).out == gpu.RESULTS


@pytest.mark.parametrize("bad", [["--gb", "0"], ["--rounds", "0"], ["--gb", "x"], ["--nope"]])
def test_bad_arguments_exit_2_saying_why(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu.parse_args(bad)
    assert exc.value.code == 2
    assert "usage: python -m bench.gpu" in capsys.readouterr().err


def test_the_ratio_keys_are_the_issues() -> None:
    assert set(gpu.RATIOS) == {
        "gpu_stall_over_pinned_d2h",
        "gpu_overlapped_stall_over_pinned_d2h",
        "gpu_first_save_over_steady",
        "gpu_restore_over_pinned_h2d",
        "gpu_speedup_vs_torch_save",
        "gpu_speedup_vs_dcp_async_blocking",
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the bench would run")
def test_without_a_gpu_it_measures_nothing_and_says_so(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.gpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stderr and "nothing written" in proc.stderr
    assert list(tmp_path.iterdir()) == []
    proc = subprocess.run([*cmd, "--require-gpu"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 3
