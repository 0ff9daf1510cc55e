"""examples/train_fsdp.py (FSDP2 on CPU with gloo) with real processes: killed at step 12 and
resumed at the same world size it ends bit-identical to an uninterrupted run; resumed at world
size 4 from the PVC it holds the same global tensors as the 2-rank run saved (issue 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gloo import free_port as _free_port
from tests.integration.test_sharded import promote

pytestmark = pytest.mark.integration
TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
JOB = "ns.sharded"


def launch(world: int, ram: Path, *args: str, pvc: Path | None = None) -> list[dict[str, Any]]:
    """Run the example as ``world`` gloo ranks; rank 0's JSON events."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
            STRATA_JOB_ID=JOB,
        )
        env.pop("STRATA_CONFIG", None)
        cmd = [sys.executable, str(TRAIN), "--ram-dir", str(ram / "node-{rank}"), *args]
        if pvc is not None:
            cmd += ["--pvc-dir", str(pvc)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        outs.append((p.returncode, out, err))
    killed = "--kill-at" in args
    for rc, _, err in outs:
        assert rc == (17 if killed else 0), err[-3000:]
    return [json.loads(line) for line in outs[0][1].splitlines() if line.startswith("{")]


def one(events: list[dict[str, Any]], name: str, step: int | None = None) -> dict[str, Any]:
    (e,) = [e for e in events if e["event"] == name and (step is None or e["step"] == step)]
    return e


def test_fsdp_example_resumes_bit_identically_and_at_another_world_size(
    shm_dir: Path, tmp_path: Path
) -> None:
    from strata.tiers.posix import PosixTier

    straight = launch(2, shm_dir / "a", "--steps", "16")
    assert one(straight, "restored")["step"] is None
    killed = launch(2, shm_dir / "b", "--steps", "16", "--kill-at", "12")
    assert [e["step"] for e in killed if e["event"] == "saved"] == [0, 5, 10]
    resumed = launch(2, shm_dir / "b", "--steps", "16")
    assert one(resumed, "restored")["step"] == 10
    assert one(resumed, "restored")["digest"] == one(killed, "saved", 10)["digest"]
    assert one(resumed, "done")["digest"] == one(straight, "done")["digest"]

    pvc = tmp_path / "pvc"
    promote(shm_dir / "b", 2, 15, PosixTier(pvc))
    wider = launch(4, shm_dir / "c", "--steps", "16", pvc=pvc)
    got = one(wider, "restored")
    assert got["step"] == 15 and got["world"] == 4
    assert got["digest"] == one(resumed, "saved", 15)["digest"]
    assert any("resharded from world size 2 to 4" in n for n in got["notes"])


def recipe(script: Path) -> tuple[dict[str, Any], list[list[str]]]:
    """The outside-Kubernetes recipe in a script's docstring: its STRATA_CONFIG and the argument
    lists of its ``torchrun``/``python`` lines."""
    import shlex

    config: dict[str, Any] | None = None
    runs = []
    for line in (script.read_text().split('"""')[1]).splitlines():
        words = shlex.split(line.strip()) if line.startswith("    ") else []
        if words[:1] == ["export"] and words[1].startswith("STRATA_CONFIG="):
            config = json.loads(words[1].split("=", 1)[1])
        elif words[:1] in (["torchrun"], ["python"]):
            runs.append(words[words.index(f"examples/{script.name}") + 1 :])
    assert config is not None and runs, "no recipe in the docstring"
    return config, runs


def test_fsdp_recipe_as_written_reaches_the_pvc_and_reshards_from_it(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Any
) -> None:
    """The docstring's recipe (sidecar + 2 ranks, then 4 ranks) with its own cadence, the
    directories moved under the test's: PVC steps exist after the first run and the second
    restores the newest step at world size 4, from the RAM directory both runs share (it holds
    every rank's shard of that step: a reshard source, issue 29), newer than the PVC's."""
    from strata.config import StrataConfig
    from strata.tiers.posix import PosixTier

    raw, runs = recipe(TRAIN)
    assert raw["pvc"]["every"]["steps"] == 10 and [r[:2] for r in runs] == [
        ["--steps", "40"],
        ["--steps", "50"],
    ]
    raw["ram"]["path"] = str(shm_dir / "ram")
    raw["pvc"]["path"] = str(tmp_path / "pvc")
    config = StrataConfig.parse(raw)
    sidecar = sidecar_proc(config, wait=False)  # metrics_port 0: no /healthz, wait for the log
    deadline = time.monotonic() + 120
    while not any(e.get("event") == "ready" for e in sidecar.log_events()):
        assert sidecar.proc.poll() is None and time.monotonic() < deadline, sidecar.logs()
        time.sleep(0.1)
    env = {"STRATA_CONFIG": json.dumps(raw)}
    first = launch_with(2, env, *runs[0])
    pvc = PosixTier(raw["pvc"]["path"], "pvc")
    # The newest step at or past 30 (the last multiple of 10 the run reached) is promoted.
    deadline = time.monotonic() + 120
    while max(pvc.complete_steps(config.job_id), default=-1) < 30:
        assert time.monotonic() < deadline, (pvc.list_steps(config.job_id), sidecar.logs())
        time.sleep(0.2)
    newest = max(pvc.complete_steps(config.job_id))
    # keep: 2. Retention prunes after the next step is complete, and a promotion in progress
    # lists a partial step: wait for the listing to settle, then at most 2 complete steps stay.
    deadline = time.monotonic() + 60
    while len(pvc.complete_steps(config.job_id)) > 2:
        assert time.monotonic() < deadline, (pvc.list_steps(config.job_id), sidecar.logs())
        time.sleep(0.2)
    wider = launch_with(4, env, *runs[1])
    got = one(wider, "restored")
    # Before issue 29 this restored the PVC's newest step (the RAM tier was no reshard source).
    newest_saved = max(e["step"] for e in first if e["event"] == "saved")
    assert newest_saved >= newest
    assert got["step"] == newest_saved and got["world"] == 4
    assert got["digest"] == one(first, "saved", newest_saved)["digest"]
    assert any("resharded from world size 2 to 4 (read from ram" in n for n in got["notes"])
    assert one(wider, "done")["step"] == 49
    assert sidecar.terminate() == 0


def launch_with(world: int, extra_env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    """Run the example as ``world`` gloo ranks configured by ``extra_env`` only; rank 0's events."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        env.update(
            extra_env,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(TRAIN), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [(p, *p.communicate(timeout=600)) for p in procs]
    for p, _, err in outs:
        assert p.returncode == 0, err[-3000:]
    return [json.loads(line) for line in outs[0][1].splitlines() if line.startswith("{")]
