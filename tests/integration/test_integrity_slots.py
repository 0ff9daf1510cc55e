"""Issue 11, failures 1 and 2: RAM slot ownership across a sidecar restart while the trainer
keeps running (real sidecar processes, SIGKILL, real tmpfs).

1. The restarted sidecar's start-up pruning deleted "surplus" slots the live trainer still
   mapped; when the ring grew again a new file appeared at the same path and size, the
   trainer wrote into the deleted inode, linked the new (zero) file as the step's data and
   checksummed it: a committed step of zeros with a matching CRC32C.
2. Two ranks in one pod: start-up pruning removed a step's data link between the trainer's link
   and its manifest write; ``save()`` returned True for a step that could not be restored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from strata.client import Checkpointer
from strata.client.sidecar_client import SidecarClient
from strata.tiers.ram import RamTier
from strata.tiers.slots import slots_dir
from tests.fixtures.leases import lease_holder
from tests.fixtures.sidecar import SidecarProcess
from tests.integration.test_sidecar import JOB, config_for

pytestmark = pytest.mark.integration
Start = Callable[..., SidecarProcess]


def state_for(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64 * 1024, generator=g), "step": step}


def test_failure1_sidecar_restart_never_deletes_a_slot_the_trainer_maps(
    shm_dir: Path, sidecar_proc: Start
) -> None:
    config = config_for(shm_dir)
    side = sidecar_proc(config)
    ring = slots_dir(shm_dir, JOB, 0)
    with Checkpointer(config, rank=0, world_size=1) as c:
        assert isinstance(getattr(c.stager, "sidecar", None), SidecarClient)
        assert c.save(1, state_for(1))
        with lease_holder(shm_dir, JOB, 1, 0):  # promotion holds step 1: the ring grows
            assert c.save(2, state_for(2))
            assert c.save(3, state_for(3))
            assert c.save(4, state_for(4))
        assert len(os.listdir(ring)) == 3
        side.kill()  # the sidecar container restarts alone; the trainer keeps running
        side = sidecar_proc(config)  # start-up pruning
        assert len(os.listdir(ring)) == 3, "a slot the live trainer maps was deleted"
        assert c.save(5, state_for(5))
        with lease_holder(shm_dir, JOB, 4, 0), lease_holder(shm_dir, JOB, 5, 0):
            assert c.save(6, state_for(6))  # needs a third slot again
        c.wait()
    with Checkpointer(config, rank=0, world_size=1) as c2:
        target = state_for(0)
        res = c2.restore(target)
    assert res.step == 6 and res.tier == "ram"
    assert torch.equal(target["w"], state_for(6)["w"])  # type: ignore[arg-type]


_RANK1 = textwrap.dedent(
    """
    import json, os, sys, torch
    from strata.client import Checkpointer
    from strata.config import StrataConfig
    config = StrataConfig.parse(json.loads(os.environ["CFG"]))
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(64 * 1024, generator=g), "step": 7}
    with Checkpointer(config, rank=1, world_size=2) as c:
        c.save(3, state)
        os.environ["STRATA_FAULT"] = "commit.linked=stop"
        ok = c.save(7, state)
        print("saved", ok, flush=True)
        c.wait()
    """
)


def test_failure2_pruning_never_removes_a_step_being_committed(
    shm_dir: Path, sidecar_proc: Start
) -> None:
    config = config_for(shm_dir)
    side = sidecar_proc(config)
    with Checkpointer(config, rank=0, world_size=2) as c0:  # the other rank of the pod
        assert c0.save(7, state_for(7))
    env = {**os.environ, "CFG": config.model_dump_json()}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK1], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        ram = RamTier(shm_dir)
        data = ram.data_path(JOB, 7, 1)
        deadline = time.monotonic() + 120
        while not data.exists():  # stopped between the link and the manifest (SIGSTOP)
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 never linked"
            time.sleep(0.01)
        while Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        side.kill()
        side = sidecar_proc(config)  # start-up pruning runs while rank 1 is mid-commit
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    saved = line == ["saved", "True"]
    committed = 7 in RamTier(shm_dir).list_steps(JOB) and 1 in (
        RamTier(shm_dir).list_steps(JOB)[7].committed_ranks
    )
    if saved:  # save() said committed: the shard must be there, whole, and verify
        assert committed, "save() returned True but step 7 of rank 1 is not committed"
        assert ram.data_path(JOB, 7, 1).exists(), "save() returned True, its data was removed"
        m = ram.get_manifest(JOB, 7, 1)
        if m.verified:
            ram.verify_file(ram.data_path(JOB, 7, 1), m)
        g = torch.Generator().manual_seed(7)
        want = torch.randn(64 * 1024, generator=g)
        got = torch.frombuffer(bytearray(ram.data_path(JOB, 7, 1).read_bytes()), dtype=torch.uint8)
        assert bytes(got[: want.numel() * 4].numpy()) == want.numpy().tobytes()
    else:
        assert not committed
