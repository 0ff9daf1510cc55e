"""Archive tiers that keep chosen components (issue 18) on real tiers: the real Checkpointer
into /dev/shm, the real engine into a PVC directory (everything) and fake-gcs-server (weights
only, archive-only steps)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from strata import Checkpointer, RestoreError
from strata.cli import main as strata_cli
from strata.config import StrataConfig
from strata.errors import ConfigError, StageError
from strata.restore.staging import stage_shard
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from tests.fixtures.gcs import GcsEmulator
from tests.integration.test_incremental import JOB, LoraTrainer, same

pytestmark = pytest.mark.integration


def config(shm: Path, pvc: Path | None, gcs: dict[str, Any] | None, **extra: Any) -> StrataConfig:
    raw: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(shm), "every": {"steps": 10}, "keep": 1},
        "writer_id": "test-pod",
        "gc_grace_seconds": 0,
        **extra,
    }
    if pvc is not None:
        raw["pvc"] = {"path": str(pvc), "every": {"steps": 10}, "keep": 2}
    if gcs is not None:
        raw["gcs"] = gcs
    return StrataConfig.parse(raw)


def test_archive_tier_keeps_weights_only_and_is_never_used_to_resume(
    shm_dir: Path,
    tmp_path: Path,
    gcs_emulator: GcsEmulator,
    gcs_bucket: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gcs_cfg = gcs_emulator.tier_config(
        gcs_bucket, every={"steps": 20}, keep=3, components=["base", "adapters"]
    ).model_dump(mode="json")
    cfg = config(shm_dir / "ram", tmp_path / "pvc", gcs_cfg)
    ram = RamTier(shm_dir / "ram", keep=1)
    pvc = PosixTier(tmp_path / "pvc")
    gcs = GcsTier(cfg.gcs, writer_id="test-pod", client=gcs_emulator.client())  # type: ignore[arg-type]
    events: list[PromotionEvent] = []
    engine = PromotionEngine(cfg, ram, {"pvc": pvc, "gcs": gcs}, on_event=events.append)
    t = LoraTrainer()
    weights = {}
    with Checkpointer(cfg, rank=0, world_size=1) as c:
        for s in (10, 20, 30, 40):
            t.train(s)
            assert c.save(s, t.state)
            c.wait()
            weights[s] = t.weights()
            engine.promote_once()
    assert gcs.complete_steps(JOB) == [20, 40]
    full = ram.get_manifest(JOB, 40, 0)
    for step in (20, 40):
        m = gcs.get_manifest(JOB, step, 0)
        assert m.components == ["adapters", "base"]
        assert "optim" not in m.tree and "step" not in m.tree
        gcs.verify_shard(JOB, step, 0)
    # the archive is weights only: no optimizer state (AdamW: 2 tensors per adapter)
    first = gcs.get_manifest(JOB, 20, 0)
    optim_bytes = 2 * sum(p.numel() * 4 for p in t.adapters.parameters())
    assert first.data_nbytes <= full.data_nbytes - optim_bytes
    assert gcs.get_manifest(JOB, 40, 0).refs is not None  # and incremental there too
    from strata.tiers.records import read_commit

    for step in (20, 40):  # the step records say so too
        rec = read_commit(gcs, JOB, step)
        assert rec is not None and rec.archive_only
    rec_pvc = read_commit(pvc, JOB, 40)
    assert rec_pvc is not None and not rec_pvc.archive_only

    # Resume: the PVC (everything) serves; the archive is never chosen, even alone.
    fresh = LoraTrainer()
    with Checkpointer(
        config(shm_dir / "ram-a", tmp_path / "pvc", gcs_cfg), rank=0, world_size=1
    ) as c2:
        res = c2.restore(fresh.state)
    assert res.step == 40 and res.tiers == {0: "pvc"} and same(fresh.weights(), weights[40])
    shutil.rmtree(tmp_path / "pvc")
    with (
        Checkpointer(config(shm_dir / "ram-b", None, gcs_cfg), rank=0, world_size=1) as c3,
        pytest.raises(RestoreError),
    ):
        c3.restore(LoraTrainer().state)
    with pytest.raises(StageError, match="archive-only"):
        stage_shard([gcs], JOB, 40, 0, tmp_path / "slot")

    # strata list / verify / export see the archive steps like any other.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    capsys.readouterr()
    url = f"gs://{gcs_bucket}"
    assert strata_cli(["verify", url, "--job", JOB, "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["copies"]
    assert {r["step"]: r["status"] for r in rows if r["rank"] is not None} == {20: "ok", 40: "ok"}
    assert strata_cli(["list", url, "--job", JOB, "-o", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    listed = listed["steps"] if isinstance(listed, dict) else listed
    by_step = {r["step"]: r for r in listed}
    assert by_step[20]["archive_only"] == ["adapters", "base"]
    assert by_step[40]["refs_base_steps"] == [20]
    out = tmp_path / "export"
    assert (
        strata_cli(
            [
                "export",
                url,
                "--job",
                JOB,
                "--step",
                "40",
                "--to",
                "safetensors",
                str(out),
                "-o",
                "json",
            ]
        )
        == 0
    )
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(f))
    for want in weights[40].values():
        assert any(v.shape == want.shape and torch.equal(v, want) for v in exported.values())


def test_an_archive_tier_first_in_restore_order_is_refused(tmp_path: Path) -> None:
    gcs = {"bucket": "bkt", "components": ["model"]}
    with pytest.raises(ConfigError, match="archive tier"):
        config(tmp_path, None, gcs, restore={"order": ["gcs", "ram"]})
    ok = config(tmp_path, None, gcs)
    assert ok.tiers_in_restore_order() == ["ram"]
    with pytest.raises(ConfigError, match="distinct"):
        config(tmp_path, None, {"bucket": "bkt", "components": ["model", "model"]})
