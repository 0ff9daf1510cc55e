"""FSDP2 training with Strata checkpoints: sharded state saved per rank, resumed at the same or
another world size.

Launch like any torch.distributed job (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT).
Outside Kubernetes, give the ranks and a ``strata sidecar`` the same configuration: the sidecar
promotes the newest RAM step at or past each multiple of 10 to the PVC directory (``keep: 2``),
so a 40-step run leaves a step from 30 on there (the default cadence of 100 steps would leave
only step 0), and a run at another world size reshards from it. The RAM directory must be a
tmpfs (/dev/shm)::

    export STRATA_CONFIG='{"job_id": "local.fsdp", "ram": {"path": "/dev/shm/strata-fsdp"}, "pvc": {"path": "/tmp/strata-fsdp-pvc", "every": {"steps": 10}}, "metrics_port": 0}'
    strata sidecar &
    torchrun --nproc-per-node 2 examples/train_fsdp.py --steps 40
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 50
    kill %1

The second run restores the newest step (35) at world size 4 by resharding it (``restored``
shows the step and the world size) and trains on to step 49. It reads that step from the RAM
directory, which holds every rank's shard of it (both runs are on one node); on new nodes it
would read the PVC's newest step (30) instead.

The model is sharded with ``fully_shard`` on a 1-D mesh (CUDA + NCCL when every rank has a GPU,
else CPU + gloo). Each saved step holds, per rank, only its shards of the parameters and of
Adam's moments (``get_state_dict``), plus its own RNG state. Restoring at the same world size is
bit-identical to a run that was never interrupted (same data order, same RNG); at another world
size the global tensors are the saved ones (the optimizer and model are resharded), and each
rank's RNG comes from the saved rank of the same number (or ``rank % saved world size``): the
RNG state and Adam's ``step`` counters are plain tensors of one rank, so the Checkpointer is
built with ``reshard_per_rank=True`` to accept that rule (without it a restore at another
world size refuses, naming them; ``strata.restore.reshard``).

Each step trains on a global batch of ``--batch`` samples drawn from a generator seeded with the
step, split evenly over the ranks, so the data does not depend on the world size. ``--kill-at N``
ends every rank abruptly (``os._exit``) after step N, as a node loss would. Output: one JSON line
per event on rank 0 (``restored``, ``saved`` with a digest of the global tensors, ``done``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import strata


def emit(rank: int, **event: object) -> None:
    if rank == 0:
        print(json.dumps(event), flush=True)


def digest(state: dict[str, object]) -> str:
    """SHA-256 over every tensor's global value (collective: every rank calls it)."""
    h = hashlib.sha256()

    def walk(x: object, key: str) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{key}.{k}")
        elif isinstance(x, torch.Tensor):
            full = x.full_tensor() if isinstance(x, DTensor) else x
            h.update(key.encode())
            h.update(
                full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )

    walk(state, "")
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch (divisible by world size)")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--ram-dir", default=None, help="RAM tier; '{rank}' is replaced per rank")
    p.add_argument("--pvc-dir", default=None)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the world size {world}")

    torch.manual_seed(0)  # same initial weights on every rank (fully_shard keeps its shard)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)  # per-rank RNG (dropout etc.), restored per rank

    settings = {}
    if args.ram_dir:
        settings["ram_dir"] = args.ram_dir.replace("{rank}", str(rank))
    if args.pvc_dir:
        settings["pvc_dir"] = args.pvc_dir
    # The RNG and Adam's step counters are per-rank plain tensors: take them by the documented
    # rule when resharding (saved rank r, or r % saved world size), rather than refusing.
    ckpt = strata.Checkpointer(allow_fresh_start=True, reshard_per_rank=True, **settings)

    def state() -> dict[str, object]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "rng": torch.get_rng_state()}

    live = state()
    res = ckpt.restore(live)
    if not res.fresh_start:
        set_state_dict(model, opt, model_state_dict=live["model"], optim_state_dict=live["optim"])
        torch.set_rng_state(live["rng"])  # type: ignore[arg-type]
    view = {"model": live["model"], "optim": live["optim"]}
    emit(
        rank,
        event="restored",
        step=res.step,
        world=world,
        digest=digest(view),
        notes=[n for n in res.skipped if "resharded" in n or "did not exist" in n],
    )

    per_rank = args.batch // world
    for step in range(res.next_step, args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, 16, generator=g)
        y = torch.randn(args.batch, 4, generator=g)
        xs = x[rank * per_rank : (rank + 1) * per_rank].to(device)
        ys = y[rank * per_rank : (rank + 1) * per_rank].to(device)
        noise = torch.randn(xs.shape) * 0.01  # uses the per-rank RNG
        loss = (model(xs + noise.to(device)) - ys).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % args.save_every == 0:
            s = state()
            ok = ckpt.save(step, s)
            ckpt.wait()
            emit(
                rank,
                event="saved",
                step=step,
                ok=ok,
                digest=digest({"model": s["model"], "optim": s["optim"]}),
            )
        if args.kill_at is not None and step == args.kill_at:
            sys.stdout.flush()
            os._exit(17)
        # SIGTERM on any rank's pod: every rank saves this step, waits until it is durable and
        # stops at the same step (the flag is all-reduced); exit 143, not "succeeded".
        if ckpt.should_stop():
            ckpt.termination.finish(step, state())  # the state dict only when stopping
            emit(rank, event="terminated", step=ckpt.last_saved_step)
            ckpt.close()
            dist.destroy_process_group()
            return ckpt.termination.exit_code
    emit(
        rank,
        event="done",
        step=args.steps - 1,
        digest=digest({"model": state()["model"], "optim": state()["optim"]}),
    )
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
