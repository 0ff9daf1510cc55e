"""Overlapped saves, slots prepared before the first save, CUDA-registered slots (issue 14)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer
from strata.client.cuda_host import HostRegistry

pytestmark = pytest.mark.integration
JOB = "ns.overlap"


def _trainer(seed: int = 0) -> tuple[torch.nn.Sequential, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, {"model": model, "optim": opt, "step": 0}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_overlapped_save_commits_what_the_state_held_when_it_was_called(shm_dir: Path) -> None:
    model, opt, state = _trainer()
    _step(model, opt, 0)
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        expected = _weights(model)
        assert c.save(1, state, blocking=False)
        # the optimizer waits for the copy by itself before changing the weights
        _step(model, opt, 1)
        assert c.wait_copied() is None  # the optimizer's hook already waited
        assert c.saves == 1 and c.failed_saves == 0 and c.last_saved_step == 1
        assert not torch.equal(_weights(model)["0.weight"], expected["0.weight"])
        res = c.restore(state)
    assert res.step == 1
    for k, v in _weights(model).items():
        assert torch.equal(v, expected[k]), k


def test_a_tensor_changed_during_the_copy_is_not_committed(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _opt, state = _trainer()
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(1, state)  # the previous committed step
        before = _weights(model)
        gate = threading.Event()
        c.saver._overlap.submit(gate.wait)  # hold the copy back until the state has changed
        assert c.save(2, state, blocking=False)
        with torch.no_grad():
            first.weight.add_(1.0)  # breaks the contract: no wait_copied() first
        gate.set()
        with caplog.at_level(logging.ERROR, logger="strata.client"):
            assert c.wait_copied() is False
        assert "changed in place" in (c.last_error or "")
        assert c.failed_saves == 1 and c.last_saved_step == 1
        committed = [s for s, lst in c.ram.list_steps(JOB).items() if lst.committed_ranks]
        assert committed == [1]
        with torch.no_grad():
            first.weight.sub_(5.0)
        assert c.restore(state).step == 1  # the previous step is intact
    for k, v in _weights(model).items():
        assert torch.equal(v, before[k]), k


def test_the_next_save_waits_for_the_one_in_flight(shm_dir: Path) -> None:
    model, opt, state = _trainer()
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        for step in range(1, 5):
            assert c.save(step, state, blocking=step % 2 == 1)
            _step(model, opt, step)
        assert c.wait_copied() in (True, None)
        assert c.saves == 4 and c.failed_saves == 0


def test_restore_prepares_every_slot_before_the_first_save(shm_dir: Path) -> None:
    _model, _opt, state = _trainer()
    with Checkpointer(
        job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, allow_fresh_start=True
    ) as c:
        assert c.restore(state).fresh_start
        c.wait()
        sizes = c.ram.slot_sizes(JOB)[0]
        assert len(sizes) == 2  # keep 1 + 1: the whole ring
        assert sorted(c.saver._maps.mapped()) == sorted(c.ram.slots_dir(JOB, 0).iterdir())
        assert c.save(1, state)
        assert c.ram.slot_sizes(JOB)[0] == sizes  # the save allocated nothing


def test_without_cuda_registration_falls_back_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the fallback is not taken")
    reg = HostRegistry()
    buf = bytearray(4096)
    with caplog.at_level(logging.WARNING, logger="strata.client"):
        assert reg.register(id(buf), len(buf)) is False
        assert reg.register(id(buf) + 1, len(buf)) is False
    lines = [r for r in caplog.records if "not registered with CUDA" in r.getMessage()]
    assert len(lines) == 1 and "CUDA is not available" in lines[0].getMessage()
    assert reg.registered_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_saves_through_registered_slots_and_restores(shm_dir: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1 << 20, generator=g).cuda(), "b": torch.randn(7, generator=g)}
    saved = {k: v.clone() for k, v in state.items()}
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, raise_on_error=True) as c:
        assert c.save(1, state)
        assert c.saver.host.registered_bytes > 0
        assert c.save(2, state, blocking=False) and c.wait_copied() is True
        state["w"].zero_()
        state["b"].zero_()
        assert c.restore(state).step == 2
    assert torch.equal(state["w"], saved["w"]) and torch.equal(state["b"], saved["b"])
