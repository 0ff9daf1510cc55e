"""Issue 11, failure 5: a restore is validated against the live state before anything is written
into it (all or nothing); a mismatch is one clear error naming the path and what differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from strata.errors import CodecError
from tests.integration.test_client import ckpt

pytestmark = pytest.mark.integration


def model_and_opt(groups: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    if groups == 2:
        groups_: list[dict[str, Any]] = [{"params": params[:2]}, {"params": params[2:], "lr": 1e-4}]
        opt = torch.optim.AdamW(groups_)
    else:
        opt = torch.optim.AdamW(params)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    if hasattr(state, "state_dict"):
        return snapshot(state.state_dict())
    return state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def test_failure5_other_number_of_param_groups_is_refused_before_anything_is_written(
    shm_dir: Path,
) -> None:
    model, opt = model_and_opt(groups=2, seed=0)
    with ckpt(shm_dir) as c:
        assert c.save(5, {"model": model, "optim": opt, "step": 5})
        c.wait()
    live_model, live_opt = model_and_opt(groups=1, seed=1)
    live = {"model": live_model, "optim": live_opt, "step": 0}
    before = snapshot(live)
    with ckpt(shm_dir) as c, pytest.raises(CodecError) as info:
        c.restore(live)
    msg = str(info.value)
    assert "state['optim']['param_groups']" in msg and "2 items in the checkpoint, 1 live" in msg
    assert same(snapshot(live), before)  # untouched: the model's weights too


def test_failure5_missing_and_extra_keys_and_shapes_are_named(shm_dir: Path) -> None:
    model, _ = model_and_opt(groups=1, seed=0)
    with ckpt(shm_dir) as c:
        assert c.save(5, {"model": model, "extra": torch.ones(3), "step": 5})
        c.wait()
    # Without an optimizer, the live dict used to gain the checkpoint's keys silently.
    live: dict[str, Any] = {"model": model_and_opt(1, 2)[0], "step": 0}
    before = snapshot(live)
    with ckpt(shm_dir) as c, pytest.raises(CodecError, match=r"keys \['extra'\] are in the "):
        c.restore(live)
    assert same(snapshot(live), before) and "extra" not in live

    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    live = {"model": other, "extra": torch.zeros(3), "step": 0}
    before = snapshot(live)
    with ckpt(shm_dir) as c, pytest.raises(CodecError) as info:
        c.restore(live)
    assert "state['model']['0.weight']: checkpoint float32[16, 8], live float32[32, 8]" in str(
        info.value
    )
    assert same(snapshot(live), before)

    live = {"model": model_and_opt(1, 3)[0], "extra": torch.zeros(3), "step": 0}
    with ckpt(shm_dir) as c:
        res = c.restore(live)  # the same shape: restored
    assert res.step == 5 and torch.equal(live["extra"], torch.ones(3))
