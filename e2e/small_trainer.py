"""A small real trainer for the end-to-end flow: torch, ``strata.Checkpointer``, gloo when
``WORLD_SIZE`` > 1, a fixed wall time per step.

Like ``examples/train.py`` but with ``--step-seconds``: the sidecar looks for due promotions
every 0.5 s, so a step that lasts longer than that lets every rank's sidecar see every step and
promote the same ones, which makes "complete on the PVC at step N" deterministic in the test.
Prints one JSON line per event: ``restored`` (rank, step, tier, seconds, weights_sha256 of the
restored model), ``saved`` (rank, step, ok, weights_sha256 of what was saved; ``error``, the
checkpointer's ``last_error``, when not ok), ``done`` (rank, step, weights_sha256).
``--ballast-mib N`` adds an N MiB tensor to the state (a state larger than the RAM tier).
SIGTERM ends it (exit 143) through the checkpointer's ``with`` block: as a container's PID 1 it
would otherwise ignore SIGTERM and be killed only after the grace period.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import strata


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def weights_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True, help="train until this step (excl.)")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument(
        "--ballast-mib",
        type=int,
        default=0,
        help="add a tensor of this many MiB to the saved state (a state larger than the RAM tier)",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if args.ballast_mib:
        state["ballast"] = torch.zeros(args.ballast_mib << 18)  # float32: 4 bytes each
    with strata.Checkpointer() as ckpt:
        result = ckpt.restore(state)
        emit(
            "restored",
            rank=rank,
            step=result.step,
            tier=result.tiers.get(rank),
            seconds=round(result.seconds, 3),
            weights_sha256=weights_sha256(model),
        )
        start = 0 if result.step is None else result.step + 1
        for step in range(start, args.steps):
            loss = model(torch.randn(8, 64)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            if dist.is_initialized():
                for p in model.parameters():
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
            optimizer.step()
            state["step"] = step
            if ckpt.should_save(step):
                ok = ckpt.save(step, state)
                extra = {} if ok else {"error": ckpt.last_error}
                emit(
                    "saved",
                    rank=rank,
                    step=step,
                    ok=ok,
                    weights_sha256=weights_sha256(model),
                    **extra,
                )
            time.sleep(args.step_seconds)
        ckpt.wait()
    emit("done", rank=rank, step=args.steps - 1, weights_sha256=weights_sha256(model))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
