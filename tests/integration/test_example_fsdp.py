"""examples/train_fsdp.py (FSDP2 on CPU with gloo) with real processes: killed at step 12 and
resumed at the same world size it ends bit-identical to an uninterrupted run; resumed at world
size 4 from the PVC it holds the same global tensors as the 2-rank run saved (issue 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
