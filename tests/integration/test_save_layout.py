"""Saves that reuse the previous save's layout (issue 14 item 6) on a real tmpfs RAM tier: a
state whose structure changes between saves is stored exactly as it is at each save, and every
committed manifest is the bytes the model itself serialises."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer
from strata.format import codec
from strata.format.manifest import Manifest
from strata.format.sealed import seal

pytestmark = pytest.mark.integration
JOB = "ns.layout"


def _snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    return state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach(), b.detach())
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _committed(c: Checkpointer, step: int) -> tuple[Manifest, Any]:
    """The committed shard of ``step`` in RAM: its manifest (checked byte for byte against
    what the model serialises) and the state it loads as."""
    path = c.ram.manifest_path(JOB, step, 0)
    raw = path.read_bytes()
    m = Manifest.from_json(raw, str(path))
    assert raw == seal(m.model_dump_json().encode())
    data = c.ram.data_path(JOB, step, 0)
    with data.open("rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE) as mm:
        loaded = codec.load(m, mm, str(data))
    return m, loaded


def test_a_state_whose_structure_changes_between_saves_is_stored_as_it_is_at_each_save(
    shm_dir: Path,
) -> None:
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "params": {f"p{i}": torch.randn(4 + i % 3, generator=g) for i in range(40)},
        "rng": torch.get_rng_state(),
        "step": 0,
    }
    changes = [
        lambda s: None,  # unchanged
        lambda s: s["params"]["p3"].add_(1),  # bytes only
        lambda s: s.update(rng=torch.get_rng_state()),  # a new tensor object, same layout
        lambda s: s["params"].update(new=torch.arange(5)),  # a new tensor
        lambda s: s["params"]["p1"].resize_(9),  # a resized one
        lambda s: setattr(s["params"]["p2"], "data", s["params"]["p2"].double()),  # a dtype
        lambda s: s["params"].pop("p0"),  # a tensor less
        lambda s: s.update(params=dict(reversed(s["params"].items()))),  # another order
        lambda s: s["params"].update(p5=s["params"]["p6"][1:]),  # a shared storage
        lambda s: s.update(rng=torch.get_rng_state()),
    ]
    expected = {}
    with Checkpointer(job_id=JOB, ram_dir=shm_dir / "ram", rank=0, world_size=1, keep=20) as c:
        for step, change in enumerate(changes, start=1):
            change(state)
            state["step"] = step
            expected[step] = _snapshot(state)
            assert c.save(step, state)
            c.wait()
        hits = c.saver._enc_cache.layout_hits
        for step in expected:
            m, loaded = _committed(c, step)
            assert m.verified
            assert _same(loaded, expected[step]), step
        restored = _snapshot(state)
        for t in restored["params"].values():
            t.zero_()
        assert c.restore(restored).step == len(changes)
    assert _same(restored, expected[len(changes)])
    # The unchanged layouts were replayed: saves 2, 3 and 10 (3 and 10 with a new RNG tensor).
    assert hits == 3


def test_prepare_encodes_ahead_so_the_first_save_reuses_the_layout(shm_dir: Path) -> None:
    state = {"w": [torch.randn(3) for _ in range(50)], "rng": torch.get_rng_state(), "n": 1}
    with Checkpointer(job_id=JOB, ram_dir=shm_dir / "ram", rank=0, world_size=1) as c:
        c.prepare(state)
        state["rng"] = torch.get_rng_state()  # a new tensor object of the same layout
        expected = _snapshot(state)
        assert c.save(1, state)
        assert c.saver._enc_cache.layout_hits == 1
        c.wait()
        m, loaded = _committed(c, 1)
        assert m.verified and _same(loaded, expected)
