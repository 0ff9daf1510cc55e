"""The trainer and sidecar processes of the fault-injection campaign (forked from a forkserver
that preloaded torch and strata, so a cycle costs a fork, not an interpreter start).

It restores (checking the restored state bit for bit against :func:`state_for` of the step it
got), then saves ``steps`` steps, appending ``restore <step|none> ok|WRONG`` and ``saved <step>``
lines to ``log_path``. ``fault``: a ``STRATA_FAULT`` rule (:mod:`strata.faults`) that kills it at
an exact point. Kept free of pytest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from strata.client import Checkpointer
from strata.config import StrataConfig
from strata.faults import ENV_FAULT


def state_for(step: int) -> dict[str, Any]:
    """The state saved as ``step`` (deterministic; ~100 KiB, a view sharing storage)."""
    g = torch.Generator().manual_seed(step)
    base = torch.randn(96, 257, generator=g)
    return {
        "model": {"w": base, "w_t": base.t(), "b": torch.randint(0, 1000, (333,), generator=g)},
        "opt": {"state": {0: {"step": torch.tensor(float(step))}}, "lr": 0.1 / (1 + step)},
        "tag": f"step-{step}",
        "step": step,
    }


def empty_state() -> dict[str, Any]:
    base = torch.zeros(96, 257)
    return {
        "model": {"w": base, "w_t": base.t(), "b": torch.zeros(333, dtype=torch.int64)},
        "opt": {"state": {}, "lr": 0.0},
        "tag": "",
        "step": -1,
    }


def same_state(got: dict[str, Any], step: int) -> bool:
    """``got`` is exactly the state saved as ``step`` (bits, views, plain values)."""
    want = state_for(step)
    gm, wm = got["model"], want["model"]
    return (
        torch.equal(gm["w"], wm["w"])
        and torch.equal(gm["b"], wm["b"])
        and gm["w_t"].data_ptr() == gm["w"].data_ptr()
        and torch.equal(gm["w_t"], wm["w"].t())
        and torch.equal(got["opt"]["state"][0]["step"], want["opt"]["state"][0]["step"])
        and got["opt"]["lr"] == want["opt"]["lr"]
        and got["tag"] == want["tag"]
        and got["step"] == step
    )


def _log(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def sidecar(env: dict[str, str], log_path: str) -> None:
    """``strata sidecar`` in a process forked from the campaign's forkserver (which preloaded
    the sidecar's modules): the same code as the command, killed for real, without an
    interpreter start and its imports per restart.

    ``env``: the ``STRATA_*`` variables (config, fault rule); the forkserver's own are dropped.
    stdout and stderr go to ``log_path``.
    """
    for key in [k for k in os.environ if k.startswith("STRATA_")]:
        del os.environ[key]
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from strata.sidecar.main import run_sidecar

    raise SystemExit(run_sidecar(log_level="INFO"))


def trainer(config_json: str, log_path: str, fault: str, steps: int) -> None:
    if fault:
        os.environ[ENV_FAULT] = fault
    log = Path(log_path)
    config = StrataConfig.parse(json.loads(config_json))
    with Checkpointer(config, rank=0, world_size=1) as c:
        state = empty_state()
        res = c.restore(state)
        ok = res.step is None or same_state(state, res.step)
        _log(
            log, f"restore {res.step if res.step is not None else 'none'} {'ok' if ok else 'WRONG'}"
        )
        start = res.next_step
        for s in range(start, start + steps):
            if c.save(s, state_for(s)):
                _log(log, f"saved {s}")
        c.wait()
    _log(log, "done")
