"""A tiny run of the benchmark (``python -m bench.run --smoke``): the harness works end to end.

Real parts: Strata's client on /dev/shm, its PVC tier on the disk, fake-gcs-server with the real
google-cloud-storage client, a real background promoter process. No timing is asserted (the
machine is shared); the test checks that the report a user reads is produced and well formed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

REQUIRED_RATIOS = (
    "save_stall_over_memcpy",
    "save_speedup_vs_torch_save",
    "save_speedup_vs_dcp_save",
    "save_speedup_vs_dcp_async_blocking",
    "promote_pvc_over_cp",
    "restore_ram_over_memcpy",
    "interference_fraction",
)


def _bench_env() -> dict[str, str]:
    """The caller's environment with the repository first on PYTHONPATH (for ``bench``), then
    whatever the caller had (a worktree's sidecar/ and operator/ must win over an editable
    install elsewhere)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_bench_smoke_writes_ratios_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--out",
            str(out),
            "--name",
            "smoke",
            "--disk-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env=_bench_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "smoke.json").read_text())
    ratios = report["ratios"]
    for key in REQUIRED_RATIOS:
        assert key in ratios, f"{key} missing from ratios; notes: {report['notes']}"
        assert math.isfinite(ratios[key]), f"{key} = {ratios[key]}; notes: {report['notes']}"
    # The saves and restores it timed are of the workload's real size (292 GPT-2 tensors).
    assert report["workloads"]["W1"]["tensors"] == 292
    save = next(v for k, v in report["sections"].items() if k.startswith("save W1"))
    assert save["cases"]["strata_save"]["error"] is None
    assert save["cases"]["torch_save"]["stats"]["seconds"]["n"] >= 1
    assert "median s" in proc.stdout  # the printed table
    assert (out / "smoke.png").stat().st_size > 10_000
    assert not report["notes"], report["notes"]


def test_bench_save_only_runs_the_save_groups_and_measures_copies_not_reuse(
    tmp_path: Path,
) -> None:
    """``--save-only`` (issue 14 item 6): W1 and W3 save groups, nothing else; every Strata save
    copied the whole state (RAM reuse is off in the save cases: the workloads never change)."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "bench.run", "--smoke", "--save-only", "--workloads", "w3"),
            *("--out", str(out), "--name", "save", "--disk-dir", str(tmp_path)),
        ],
        cwd=REPO,
        env=_bench_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "save.json").read_text())
    ratios = report["ratios"]
    for key in ("save_stall_over_memcpy", "w3_save_stall_over_memcpy"):
        assert math.isfinite(ratios[key]), f"{key} = {ratios.get(key)}; {report['notes']}"
    assert not any(k.startswith(("promote", "restore", "interference")) for k in ratios)
    assert {k.split(":")[0] for k in report["sections"] if k.startswith("save ")} == {
        "save W1",
        "save W3",
    }
    assert not report["notes"], report["notes"]


def test_bench_strata_saves_copy_the_whole_unchanged_state(shm_dir: Path) -> None:
    """The save cases time the copy: an unchanged state saved again into a slot that holds it
    is still copied in full (RAM reuse would leave it in place; bench/incremental measures it)."""
    import torch
    from bench.strata_cases import StrataSaver

    state = {"w": torch.randn(1 << 20), "b": torch.randn(1 << 18)}
    s = StrataSaver(shm_dir / "ram", threads=2)
    try:
        for _ in range(4):  # the ring of two slots, each saved into twice
            s.save(state)
            s.wait_committed()
            copied = s.ck.saver.last_copied_nbytes
            assert copied is not None and copied >= (1 << 22) + (1 << 20)
    finally:
        s.close()


def test_bench_archive_weights_only_writes_a_third_of_a_full_finetune(tmp_path: Path) -> None:
    """``python -m bench.archive`` at 4 MiB: an archive tier keeping ``components: [model]`` of an
    AdamW full fine-tune uploads the weights only (a third of the step's bytes)."""
    out = tmp_path / "archive.json"
    argv = [sys.executable, "-m", "bench.archive", "--model-mib", "4", "--steps", "1"]
    proc = subprocess.run(
        [*argv, "--out", str(out)],
        cwd=REPO,
        env=_bench_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["full_gcs_bytes"] == row["ram_bytes"]
    assert row["weights_gcs_bytes"] == doc["model_bytes"]
    assert abs(row["weights_over_full"] - 1 / 3) < 0.01
