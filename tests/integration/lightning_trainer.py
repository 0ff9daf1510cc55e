"""A Lightning trainer using StrataCheckpointIO (run as a script by test_integrations_lightning.py).

5 epochs of 4 steps; ``ModelCheckpoint`` saves at every epoch end (``epoch={e}-step={s}.ckpt``,
plus ``last.ckpt``) through the plugin; every run calls ``trainer.fit(..., ckpt_path="last")``
(a fresh start when there is none). The data order is fixed (Lightning does not checkpoint the
global RNG, so a shuffled order would differ after any resume). See tests/fixtures/resume.py for
``--pause-at``.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from strata.integrations.lightning import StrataCheckpointIO
from tests.fixtures.resume import pause_here


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PauseAt(pl.Callback):
    def __init__(self, step: int | None, progress: str | None) -> None:
        self.step, self.progress = step, progress

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            pause_here(self.progress)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ram", required=True)
    ap.add_argument("--dirpath", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pause-at", type=int)
    ap.add_argument("--progress")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).repeat(1, 3)), batch_size=8)
    model = Tiny()
    io = StrataCheckpointIO(job_id="ns.lightning", ram_dir=a.ram, keep=2)
    trainer = pl.Trainer(
        max_epochs=5,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        plugins=[io],
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=a.dirpath, every_n_epochs=1, save_top_k=-1, save_last=True
            ),
            PauseAt(a.pause_at, a.progress),
        ],
    )
    trainer.fit(model, data, ckpt_path="last")
    restored = io.checkpointer.incarnation
    print(f"global_step {trainer.global_step} incarnation {restored}", flush=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
