"""A small training job protected by Strata: what the example workloads in examples/ run.

A character-level language model (embedding + 2-layer MLP over a context window) trained on the
English text that ships with Python (``pydoc_data.topics``), on CPU, with torch.distributed (gloo)
when ``WORLD_SIZE`` > 1 (torchrun, PyTorchJob, or an indexed Job / JobSet that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``).

Checkpointing is three calls of :class:`strata.Checkpointer`, configured entirely by what the
webhook injects (``STRATA_CONFIG``) in a pod:

1. ``ckpt.restore(state)``: load, in place, the newest step restorable on every rank from the
   nearest tier (RAM, then PVC, then GCS); a fresh start only when the policy allows it;
2. ``ckpt.should_save(step)``: the RAM tier's cadence (``spec.tiers.ram.every``);
3. ``ckpt.save(step, state)``: blocks only for the copy into a RAM slot; the sidecar promotes
   to the PVC and GCS in the background;
4. ``ckpt.should_stop(step, state)``: False until the pod gets SIGTERM (preemption, drain,
   deletion); then it saves the current step to RAM, waits until the sidecar has made it
   durable on the PVC (within the pod's grace period) and returns True: the loop ends and the
   script exits with status 143, so that the Job does not count the pod as succeeded
   (README "Preemption").

Outside Kubernetes, give it and a ``strata sidecar`` the same configuration (the RAM directory
on a tmpfs; the sidecar promotes the newest RAM step at or past each multiple of 10 to the PVC
directory, ``keep: 2``, so a 50-step run leaves a step from 40 on there)::

    export STRATA_CONFIG='{"job_id": "local.train", "ram": {"path": "/dev/shm/strata-train"}, "pvc": {"path": "/tmp/strata-train-pvc", "every": {"steps": 10}}, "metrics_port": 0}'
    strata sidecar &
    python examples/train.py --steps 50 --allow-fresh-start
    kill %1

Run it again with more steps and it resumes where the newest checkpoint left off. Prints one
JSON line per event (``restored``, ``step``, ``done``) so that logs are easy to follow and test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import strata


def corpus() -> bytes:
    """About 1 MB of English text from the Python documentation (ships with CPython)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics)).encode("utf-8", errors="replace")


class CharModel(nn.Module):
    """Predicts the next byte from the previous ``context`` bytes; tensors of shape [batch, ...]."""

    def __init__(self, context: int = 16, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.mlp = nn.Sequential(
            nn.Flatten(), nn.Linear(context * dim, hidden), nn.GELU(), nn.Linear(hidden, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.mlp(self.embed(x))
        return logits


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="train until this step (exclusive)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step and rank")
    parser.add_argument("--context", type=int, default=16, help="bytes of context per sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument(
        "--allow-fresh-start",
        action="store_true",
        help="start from step 0 when no checkpoint exists (default: the policy's "
        "restore.allowFreshStart; outside Kubernetes: refuse)",
    )
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from env
    rank = dist.get_rank() if dist.is_initialized() else 0

    torch.manual_seed(args.seed)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    model = CharModel(context=args.context)
    if dist.is_initialized():
        # Every rank starts from rank 0's weights; restore() then overwrites all of them alike.
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    # Everything a bit-exact resume needs: weights, optimizer moments, step, data-order RNG.
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "step": 0,
        "data_rng": generator.get_state(),
    }

    with strata.Checkpointer(allow_fresh_start=True if args.allow_fresh_start else None) as ckpt:
        result = ckpt.restore(state)
        start = 0 if result.step is None else result.step + 1
        generator.set_state(state["data_rng"])
        emit(
            "restored",
            rank=rank,
            step=result.step,
            tier=result.tiers.get(rank),
            seconds=round(result.seconds, 3),
            skipped=result.skipped,
        )
        loss_fn = nn.CrossEntropyLoss()
        for step in range(start, args.steps):
            idx = torch.randint(
                0, data.numel() - args.context - 1, (args.batch,), generator=generator
            )
            x = torch.stack([data[i : i + args.context] for i in idx.tolist()])
            y = data[idx + args.context]
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if dist.is_initialized():
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= world_size
            optimizer.step()
            state["step"] = step
            state["data_rng"] = generator.get_state()
            if ckpt.should_save(step):
                t0 = time.perf_counter()
                saved = ckpt.save(step, state)
                stall = time.perf_counter() - t0
                if not saved:
                    # A failed save never stops training; the previous checkpoint is intact.
                    emit("save-failed", rank=rank, step=step, error=ckpt.last_error)
            else:
                stall = None
            if step % args.log_every == 0 or step == args.steps - 1:
                emit("step", rank=rank, step=step, loss=round(loss.item(), 4), stall=stall)
            if ckpt.should_stop(step, state):
                out = ckpt.termination.outcome
                emit(
                    "terminated",
                    rank=rank,
                    step=ckpt.last_saved_step,
                    durable_step=out.durable_step if out is not None else None,
                    seconds=round(ckpt.termination.since_signal(), 3),
                )
                break
        ckpt.wait()
    if ckpt.termination.requested:
        return ckpt.termination.exit_code
    # A digest of the final weights: a resumed run must end bit-identical to an uninterrupted one.
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    emit("done", rank=rank, steps=args.steps, weights_sha256=digest.hexdigest())
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
