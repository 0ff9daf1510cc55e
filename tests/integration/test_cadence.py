"""Components at their own cadence (issue 18): EMA weights snapshotted every 30 steps and
carried in between; the step record and the restore say from which step they come; promoted
copies store the carried bytes once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata import Checkpointer
from strata.sidecar.promotion import PromotionEngine
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from tests.integration.test_incremental import config

pytestmark = pytest.mark.integration
JOB = "ns.lora"


def test_ema_every_30_steps_is_carried_and_reported(shm_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ema = torch.nn.Linear(2048, 2048)  # 16 MiB: whole chunks the promotion can reference
    state = {"model": model, "ema": ema, "step": 0}
    cfg = config(shm_dir / "ram", tmp_path / "pvc", None)
    ram = RamTier(shm_dir / "ram", keep=1)
    pvc = PosixTier(tmp_path / "pvc")
    engine = PromotionEngine(
        cfg.model_copy(update={"ram": cfg.ram.model_copy(update={"keep": 3})}), ram, {"pvc": pvc}
    )
    emas, models = {}, {}
    with Checkpointer(cfg, rank=0, world_size=1, keep=3, component_every={"ema": 30}) as c:
        for s in (10, 20, 30, 40, 50):
            with torch.no_grad():
                model.weight.add_(1.0)
                ema.weight.mul_(0.5).add_(float(s))
            emas[s] = ema.weight.clone()
            models[s] = model.weight.clone()
            state["step"] = s
            assert c.save(s, state)
            c.wait()
            engine.promote_once()
        expected = {10: 10, 20: 10, 30: 30, 40: 30, 50: 30}
        for s, src in expected.items():
            if s in ram.complete_steps(JOB):
                assert ram.get_manifest(JOB, s, 0).component_steps == {"ema": src}
        for s in (40, 50):
            m = pvc.get_manifest(JOB, s, 0)
            assert m.component_steps == {"ema": 30}
        assert pvc.get_manifest(JOB, 50, 0).refs is not None  # the carried EMA stored once

        with torch.no_grad():
            ema.weight.zero_()
            model.weight.zero_()
        res = c.restore(state)
    assert res.step == 50 and res.component_steps == {"ema": 30}
    assert torch.equal(ema.weight, emas[30])
    assert torch.equal(model.weight, models[50])  # the fast component is from step 50 itself
