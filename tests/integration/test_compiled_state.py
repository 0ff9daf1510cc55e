"""Overlapped saves of a state that ``torch.compile``d code changes in place.

An overlapped save notices a state changed during its copy through the tensors' version
counters, and makes every optimizer of the state wait for the copy through a step pre-hook
(:mod:`strata.client.versions`). Both must hold when the training step is compiled: a compiled
optimizer step must still wait (or be caught), and an in-place update from a compiled graph
must still move the counters. Run with AOTAutograd alone and with Inductor (CPU code
generation, so a C compiler is needed: gcc here). CUDA graphs (``mode="reduce-overhead"``)
replay kernels without going through the dispatcher and need a GPU: not covered here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
JOB = "ns.compiled"
BACKENDS = ["aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trainer() -> tuple[torch.nn.Sequential, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, {"model": model, "optim": opt, "step": 0}


def _grads(model: torch.nn.Module, i: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
    model.zero_grad()
    model(x).pow(2).mean().backward()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_optimizer_step_after_an_overlapped_save_leaves_the_saved_bytes(
    shm_dir: Path, backend: str
) -> None:
    model, opt, state = _trainer()
    step = torch.compile(opt.step, backend=backend)
    _grads(model, 0)
    step()  # compiled once, before any save
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        expected = _weights(model)
        gate = threading.Event()
        c.saver._overlap.submit(gate.wait)  # the copy cannot land before the step starts
        assert c.save(1, state, blocking=False)
        _grads(model, 1)
        threading.Timer(0.2, gate.set).start()
        step()  # either the pre-hook waits for the copy, or the counters catch the change
        c.wait()
        assert not torch.equal(_weights(model)["0.weight"], expected["0.weight"])
        committed = [s for s, lst in c.ram.list_steps(JOB).items() if lst.committed_ranks]
        if committed:  # what was committed is what the state held when save() was called
            assert committed == [1] and c.failed_saves == 0
            assert c.restore(state).step == 1
            for k, v in _weights(model).items():
                assert torch.equal(v, expected[k]), k
        else:
            assert c.failed_saves == 1 and "changed in place" in (c.last_error or "")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_in_place_update_from_a_compiled_graph_during_the_copy_is_not_committed(
    shm_dir: Path, backend: str
) -> None:
    model, _opt, state = _trainer()
    first = model[0]
    assert isinstance(first, torch.nn.Linear)

    @torch.compile(backend=backend)
    def nudge(w: torch.Tensor) -> None:
        w.mul_(0.5).add_(1.0)

    with torch.no_grad():
        nudge(first.weight)  # compiled once, before any save
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(1, state)
        before = _weights(model)
        gate = threading.Event()
        c.saver._overlap.submit(gate.wait)
        assert c.save(2, state, blocking=False)
        version = first.weight._version
        with torch.no_grad():
            nudge(first.weight)  # breaks the contract (no wait_copied() first), from a graph
        assert first.weight._version != version, "the compiled graph did not move the counter"
        gate.set()
        assert c.wait_copied() is False
        assert "changed in place" in (c.last_error or "")
        committed = [s for s, lst in c.ram.list_steps(JOB).items() if lst.committed_ranks]
        assert committed == [1]
        assert c.restore(state).step == 1
    for k, v in _weights(model).items():
        assert torch.equal(v, before[k]), k
