"""A transformers.Trainer using StrataCallback (run as a script by test_integrations_hf.py).

A tiny regression model, 32 samples in batches of 4 (8 steps an epoch, shuffled by the Trainer's
seeded sampler), 20 steps with a linear warm-up/decay schedule and dropout; Strata saves every
4 steps, the Trainer's own checkpoints are off. Every run starts with
``trainer.train(resume_from_checkpoint=resume_checkpoint(ckpt, output_dir))``. See
tests/fixtures/resume.py for ``--pause-at``.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from strata.client import Checkpointer
from strata.integrations.hf import StrataCallback, resume_checkpoint
from tests.fixtures.resume import pause_here


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        out = self.net(x)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i].sum().repeat(3)}


class PauseAt(TrainerCallback):
    def __init__(self, step: int | None, progress: str | None) -> None:
        self.step, self.progress = step, progress

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            pause_here(self.progress)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ram", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pause-at", type=int)
    ap.add_argument("--progress")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tiny()
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=20,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=3,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    with Checkpointer(
        job_id="ns.hf", ram_dir=a.ram, rank=0, world_size=1, keep=2, allow_fresh_start=True
    ) as ckpt:
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Data(),
            callbacks=[StrataCallback(ckpt, every_steps=4), PauseAt(a.pause_at, a.progress)],
        )
        resume = resume_checkpoint(ckpt, a.output_dir)
        print(f"resume from {resume}", flush=True)
        trainer.train(resume_from_checkpoint=resume)
        print(f"global_step {trainer.state.global_step}", flush=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
