"""Graceful termination of a 2-rank job (gloo on loopback), real processes and signals: two
"pods", each a trainer rank beside its own ``strata sidecar`` with its own RAM directory on the
machine's tmpfs, one shared PVC directory.

One pod is terminated (the kubelet SIGTERMs only its trainer): ``should_stop`` agrees over the
ranks, so both stop at the same step, both save it and have their sidecar make it durable, and
the step is complete (every rank's shards) on the PVC. Replacement ranks with empty RAM restore
it, byte for byte. The PVC interval is never due: only the termination flushes put it there.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from strata.tiers.posix import PosixTier
from tests.fixtures import gloo
from tests.fixtures.sidecar import SidecarProcess
from tests.integration.test_termination import (
    GRACE,
    JOB,
    Trainer,
    config_for,
    ram_dirs,  # noqa: F401 (fixture)
    trainers,  # noqa: F401 (fixture)
    wait_until,
)

pytestmark = pytest.mark.integration

Start = Callable[..., SidecarProcess]
MIB = 64
"""Per rank; 2 ranks on a shared 2-core machine (the 256 MiB case is test_termination.py)."""
WORLD = 2


def rank_env(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def start_job(
    tmp_path: Path,
    name: str,
    new_ram: Callable[[], Path],
    pvc: Path,
    sidecar_proc: Start,
    start_trainer: Callable[..., Trainer],
    mode: str,
) -> tuple[list[SidecarProcess], list[Trainer]]:
    port = gloo.free_port()
    sides, ranks = [], []
    for r in range(WORLD):
        config = config_for(new_ram(), pvc).model_copy(update={"writer_id": f"{name}-{r}"})
        sides.append(sidecar_proc(config))
        ranks.append(
            start_trainer(
                config, mode, tmp_path / f"{name}-{r}.log", mib=MIB, env=rank_env(r, port)
            )
        )
    return sides, ranks


def test_one_pod_terminated_stops_every_rank_at_the_same_step_and_it_is_durable(
    tmp_path: Path,
    ram_dirs: Callable[[], Path],  # noqa: F811 (the imported fixture)
    sidecar_proc: Start,
    trainers: Callable[..., Trainer],  # noqa: F811
) -> None:
    pvc = tmp_path / "pvc"
    sides, ranks = start_job(tmp_path, "pod", ram_dirs, pvc, sidecar_proc, trainers, "poll")
    for t in ranks:
        t.wait_saved(2)
    t0 = time.monotonic()
    # Only rank 1's pod is terminating; rank 0 hears of it through should_stop's all-reduce.
    codes = [0, 0]
    ranks[1].proc.send_signal(signal.SIGTERM)
    for r in (1, 0):
        codes[r] = ranks[r].proc.wait(GRACE)
    exited = time.monotonic() - t0
    assert codes == [128 + signal.SIGTERM] * WORLD, [t.lines() for t in ranks]
    finals = []
    for t in ranks:
        final = [line.split() for line in t.lines() if line.startswith("final ")]
        assert len(final) == 1, t.lines()
        finals.append(final[0])
    steps = {int(f[1]) for f in finals}
    assert len(steps) == 1, finals  # the same step on every rank
    (step,) = steps
    assert step > max(max(t.saved()) for t in ranks)
    # Each rank's own sidecar confirmed it durable within the grace period.
    assert [(int(f[2]), f[3]) for f in finals] == [(step, "True")] * WORLD
    wait_until(
        lambda: step in PosixTier(pvc).complete_steps(JOB),
        timeout=GRACE,
        what=f"step {step} complete on the PVC",
    )
    print(f"2 ranks: both stopped at step {step}, exited {exited:.2f}s after SIGTERM ({MIB} MiB)")
    for side in sides:
        assert side.terminate(timeout=GRACE) == 0, side.logs()

    # The replacement pods: empty RAM, the same PVC; both ranks restore the step, bytes checked.
    new_sides, replacements = start_job(
        tmp_path, "new", ram_dirs, pvc, sidecar_proc, trainers, "restore"
    )
    for t in replacements:
        assert t.proc.wait(240) == 0, t.lines()
    restored = [
        next(line.split() for line in t.lines() if line.startswith("restored "))
        for t in replacements
    ]
    assert restored == [["restored", str(step), "pvc", "True"]] * WORLD
    for side in new_sides:
        side.terminate(timeout=GRACE)
