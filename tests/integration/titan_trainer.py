"""A torchtitan-shaped trainer (run as a script by test_integrations_torchtitan.py).

Its states are what torchtitan's CheckpointManager hands DCP: ``Stateful`` wrappers of the model
(``get_model_state_dict``), the optimizer (``get_optimizer_state_dict``), the dataloader and the
train state; saved every 4 steps with ``strata_titan.dcp_save(states, f"{folder}/step-{step}")``,
resumed from ``find_load_step``. See tests/fixtures/resume.py for ``--pause-at``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from strata.client import Checkpointer
from strata.integrations import torchtitan as strata_titan
from tests.fixtures.resume import pause_here

STEPS = 20
EVERY = 4
FOLDER = "outputs/checkpoint"


class ModelWrapper:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd)


class OptimizersContainer:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.opt, sd)


class Loader:
    """A deterministic stream of batches; its position is its state (torchtitan's dataloader
    is Stateful the same way)."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + self.position)
        self.position += 1
        x = torch.randn(8, 6, generator=g)
        return x, x.sum(dim=1, keepdim=True).repeat(1, 3)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"].item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ram", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--async-mode", default="disabled", choices=["disabled", "async"])
    ap.add_argument("--pause-at", type=int)
    ap.add_argument("--progress")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader, train = Loader(), TrainState()
    states: dict[str, Any] = {
        "model": ModelWrapper(model),
        "optimizer": OptimizersContainer(model, opt),
        "dataloader": loader,
        "train_state": train,
    }
    pg = None
    if a.async_mode == "async":  # torchtitan's async mode saves over a gloo group
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        pg = dist.new_group(backend="gloo")
    with Checkpointer(job_id="ns.titan", ram_dir=a.ram, rank=0, world_size=1, keep=2) as ckpt:
        step = strata_titan.find_load_step(ckpt)
        if step >= 0:
            strata_titan.dcp_load(states, f"{FOLDER}/step-{step}", ckpt)
            assert train.step == step, (train.step, step)
            # The LR schedule is a function of the step (torchtitan saves its schedulers too).
            sched.last_epoch = step
            print(f"resumed from step {step}", flush=True)
        pending = None
        while train.step < STEPS:
            train.step += 1
            x, y = loader.next()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if train.step % EVERY == 0:
                if pending is not None:
                    pending.result()
                pending = strata_titan.dcp_save(
                    states,
                    f"{FOLDER}/step-{train.step}",
                    ckpt,
                    a.async_mode,
                    pg,
                )
            if train.step == a.pause_at:
                if pending is not None:
                    pending.result()
                pause_here(a.progress)
        if pending is not None:
            pending.result()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
