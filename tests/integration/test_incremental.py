"""Incremental shards (issue 18) on real tiers: a frozen-base fine-tune saved by the real
Checkpointer into /dev/shm, promoted by the real engine into a PVC directory and
fake-gcs-server; restores from each tier alone; retention and corruption of referenced bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from strata import Checkpointer
from strata.cli import main as strata_cli
from strata.config import StrataConfig
from strata.format.incremental import full_manifest, plan_refs
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from tests.fixtures.gcs import GcsEmulator

pytestmark = pytest.mark.integration

JOB = "ns.lora"
MIB = 1024 * 1024


class LoraTrainer:
    """A frozen base (3 x 4 MiB, requires_grad False) plus small adapters trained with AdamW."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.base = torch.nn.ModuleList(
            [torch.nn.Linear(1024, 1024, bias=False) for _ in range(3)]
        ).requires_grad_(False)
        self.adapters = torch.nn.ModuleList(
            [torch.nn.Linear(1024, 8, bias=False), torch.nn.Linear(8, 1024, bias=False)]
        )
        self.opt = torch.optim.AdamW(self.adapters.parameters(), lr=1e-2)
        self.state: dict[str, Any] = {
            "base": self.base,
            "adapters": self.adapters,
            "optim": self.opt,
            "step": 0,
        }

    def train(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 1024, generator=g)
        h = self.base[0](x)
        loss = (h + self.adapters[1](self.adapters[0](x))).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.state["step"] = step

    def weights(self) -> dict[str, torch.Tensor]:
        out = {f"base.{k}": v.clone() for k, v in self.base.state_dict().items()}
        out.update({f"ad.{k}": v.clone() for k, v in self.adapters.state_dict().items()})
        return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def config(shm: Path, pvc: Path | None, gcs: dict[str, Any] | None) -> StrataConfig:
    raw: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(shm), "every": {"steps": 10}, "keep": 1},
        "writer_id": "test-pod",
        "gc_grace_seconds": 0,
        "restore": {"allow_fresh_start": False},
    }
    if pvc is not None:
        raw["pvc"] = {"path": str(pvc), "every": {"steps": 10}, "keep": 2}
    if gcs is not None:
        raw["gcs"] = gcs
    return StrataConfig.parse(raw)


class Rig:
    def __init__(self, shm: Path, tmp: Path, emu: GcsEmulator, bucket: str) -> None:
        self.gcs_cfg = emu.tier_config(bucket, every={"steps": 10}, keep=2).model_dump(mode="json")
        self.pvc_dir = tmp / "pvc"
        self.cfg = config(shm / "ram", self.pvc_dir, self.gcs_cfg)
        self.ram = RamTier(shm / "ram", keep=1)
        self.pvc = PosixTier(self.pvc_dir)
        self.gcs = GcsTier(self.cfg.gcs, writer_id="test-pod", client=emu.client())  # type: ignore[arg-type]
        self.events: list[PromotionEvent] = []
        self.engine = PromotionEngine(
            self.cfg, self.ram, {"pvc": self.pvc, "gcs": self.gcs}, on_event=self.events.append
        )

    def written(self, tier: str, step: int) -> int:
        return sum(
            e.nbytes
            for e in self.events
            if e.kind == "promoted" and e.tier == tier and e.step == step
        )


def run_steps(rig: Rig, c: Checkpointer, t: LoraTrainer, steps: list[int]) -> dict[int, Any]:
    weights = {}
    for s in steps:
        t.train(s)
        assert c.save(s, t.state)
        c.wait()
        weights[s] = t.weights()
        rig.engine.promote_once()
    return weights


def test_frozen_base_is_stored_once_and_restores_from_each_tier_alone(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        w = run_steps(rig, c, t, [10, 20, 30])
    full = rig.ram.get_manifest(JOB, 30, 0)
    assert full.refs is None and full.data_nbytes > 12 * MIB
    for tier in (rig.pvc, rig.gcs):
        m10 = tier.get_manifest(JOB, 10, 0)
        assert m10.refs is None  # the first copy is full: the base
        for step in (20, 30):
            m = tier.get_manifest(JOB, step, 0)
            assert m.refs is not None and m.refs.base_step == 10
            # only the chunks touching adapters/optimizer state are stored again
            assert m.data_nbytes <= full.data_nbytes - 2 * 4 * MIB
            tier.verify_shard(JOB, step, 0)
        # retention keeps 2 steps, and step 10 because both kept steps reference it
        assert tier.complete_steps(JOB) == [10, 20, 30]
    for name in ("pvc", "gcs"):
        assert rig.written(name, 30) < rig.written(name, 10) / 2

    # Restore from each tier alone (empty RAM): bit-identical to step 30.
    for name, cfg in (
        ("pvc", config(shm_dir / "ram-a", rig.pvc_dir, None)),
        ("gcs", config(shm_dir / "ram-b", None, rig.gcs_cfg)),
    ):
        fresh = LoraTrainer()
        fresh.train(999)
        with Checkpointer(cfg, rank=0, world_size=1) as c2:
            res = c2.restore(fresh.state)
        assert res.step == 30 and res.tiers == {0: name}, res
        assert same(fresh.weights(), w[30])

    # strata verify follows the references; strata export reassembles the incremental copy.
    assert strata_cli(["verify", str(rig.pvc_dir), "--job", JOB, "-o", "json"]) == 0
    out = tmp_path / "export"
    spec = str(rig.pvc_dir)
    assert (
        strata_cli(["export", spec, "--job", JOB, "--step", "30", "--to", "safetensors", str(out)])
        == 0
    )
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_file(f))
    for want in w[30].values():
        assert any(v.shape == want.shape and torch.equal(v, want) for v in exported.values())


def test_retention_frees_a_base_only_when_nothing_kept_references_it(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        run_steps(rig, c, t, [10, 20, 30, 40])
        assert rig.pvc.complete_steps(JOB) == [10, 30, 40]
        # The base changes (the frozen weights are replaced): the next copy is full, the
        # one after references it, and the old base is released.
        with torch.no_grad():
            for p in t.base.parameters():
                p.mul_(0.5)
        w = run_steps(rig, c, t, [50, 60, 70])
    for tier in (rig.pvc, rig.gcs):
        m50 = tier.get_manifest(JOB, 50, 0)
        assert m50.refs is None
        assert tier.get_manifest(JOB, 70, 0).refs is not None
        assert tier.complete_steps(JOB) == [50, 60, 70]
    fresh = LoraTrainer()
    with Checkpointer(config(shm_dir / "ram-c", rig.pvc_dir, None), rank=0, world_size=1) as c2:
        res = c2.restore(fresh.state)
    assert res.step == 70 and same(fresh.weights(), w[70])


def test_a_corrupt_referenced_chunk_is_detected_and_the_restore_falls_back(
    shm_dir: Path,
    tmp_path: Path,
    gcs_emulator: GcsEmulator,
    gcs_bucket: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        w = run_steps(rig, c, t, [10, 20])
    m20 = rig.pvc.get_manifest(JOB, 20, 0)
    assert m20.refs is not None
    k = m20.refs.chunks[0]
    base = rig.pvc.data_path(JOB, 10, 0)
    raw = bytearray(base.read_bytes())
    raw[k * m20.chunk_size + 7] ^= 0x01
    base.write_bytes(bytes(raw))
    # strata verify: step 10's own copy is bad, and so is step 20, which reads that chunk
    capsys.readouterr()
    assert strata_cli(["verify", str(rig.pvc_dir), "--job", JOB, "-o", "json"]) == 1
    rows = json.loads(capsys.readouterr().out)["copies"]
    status = {r["step"]: r["status"] for r in rows if r["rank"] is not None}
    assert status == {10: "corrupt", 20: "corrupt"}, rows
    fresh = LoraTrainer()
    with Checkpointer(
        config(shm_dir / "ram-d", rig.pvc_dir, rig.gcs_cfg), rank=0, world_size=1
    ) as c2:
        res = c2.restore(fresh.state)
    assert res.step == 20 and res.tiers == {0: "gcs"}, res
    assert same(fresh.weights(), w[20])
    assert any(n.startswith("pvc:") and "base step 10" in n for n in res.skipped), res.skipped
    # the corrupt base and the step that needed it are no longer served by the PVC
    assert 10 not in rig.pvc.complete_steps(JOB)
    assert 20 not in rig.pvc.complete_steps(JOB)


def test_no_references_across_incarnations_or_to_later_steps(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        run_steps(rig, c, t, [10, 20, 30])
        # Resume from step 20 (as after a failure): a later save never references step 30,
        # and the restore itself resets the trainer's unchanged hint.
        with Checkpointer(config(shm_dir / "ram-e", rig.pvc_dir, None), rank=0, world_size=1) as c2:
            assert c2.restore(t.state).step == 30
    full = rig.pvc.get_manifest(JOB, 30, 0)
    base = rig.pvc.get_manifest(JOB, 10, 0)
    later = full_manifest(rig.pvc.get_manifest(JOB, 20, 0))
    assert plan_refs(later, full) == []  # a base must be older than the step
    assert plan_refs(full_manifest(full), base)  # same incarnation: shared chunks found
    other = full_manifest(full).model_copy(update={"incarnation": "b"})
    assert plan_refs(other, base.model_copy(update={"incarnation": "a"})) == []
    no_hint = full_manifest(full).model_copy(update={"unchanged_since": None})
    assert plan_refs(no_hint, base) == []


def test_a_new_incarnation_writes_its_own_base(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    """After a restore (a new incarnation), the same promotion engine never references the
    superseded incarnation's bytes: the first copy is full, later ones reference it."""
    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        run_steps(rig, c, t, [10, 20])
        old = rig.pvc.get_manifest(JOB, 20, 0)
        assert old.refs is not None and old.refs.base_step == 10
        res = c.restore(t.state)  # opens a new incarnation resuming from step 20
        assert res.step == 20 and c.incarnation and c.incarnation != old.incarnation
        w = run_steps(rig, c, t, [30, 40])
    for tier in (rig.pvc, rig.gcs):
        m30 = tier.get_manifest(JOB, 30, 0)
        m40 = tier.get_manifest(JOB, 40, 0)
        assert m30.incarnation == m40.incarnation != old.incarnation
        assert m30.refs is None  # never a reference into the old incarnation's step 10
        assert m40.refs is not None and m40.refs.base_step == 30
    fresh = LoraTrainer()
    with Checkpointer(config(shm_dir / "ram-f", rig.pvc_dir, None), rank=0, world_size=1) as c2:
        res = c2.restore(fresh.state)
    assert res.step == 40 and same(fresh.weights(), w[40])


def test_a_restarted_sidecar_finds_the_base_in_the_tier(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        run_steps(rig, c, t, [10])
        # a new engine (the sidecar restarted): it remembers nothing, the tier tells it
        rig.engine = PromotionEngine(
            rig.cfg, rig.ram, {"pvc": rig.pvc, "gcs": rig.gcs}, on_event=rig.events.append
        )
        run_steps(rig, c, t, [20])
    for tier in (rig.pvc, rig.gcs):
        m = tier.get_manifest(JOB, 20, 0)
        assert m.refs is not None and m.refs.base_step == 10


def test_a_corrupt_gcs_base_is_detected_before_download_and_the_restore_falls_back(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    """GCS reassembles an incremental copy by downloading its base straight into the slot (no
    temporary copy of the base); a base whose stored object no longer matches its manifest is
    quarantined and the restore falls back to the PVC's copy of the same step."""
    from strata.errors import ShardCorrupt
    from strata.format import layout
    from strata.tiers.references import verify_following_refs

    rig = Rig(shm_dir, tmp_path, gcs_emulator, gcs_bucket)
    t = LoraTrainer()
    with Checkpointer(rig.cfg, rank=0, world_size=1) as c:
        w = run_steps(rig, c, t, [10, 20])
    assert rig.gcs.get_manifest(JOB, 20, 0).refs is not None
    verify_following_refs(rig.gcs, JOB, 20, 0)  # intact: the remote path reassembles it
    blob = (
        gcs_emulator.client()
        .bucket(gcs_bucket)
        .blob(rig.gcs.object_name(layout.data_key(JOB, 10, 0)))
    )
    raw = bytearray(blob.download_as_bytes())
    raw[len(raw) // 2] ^= 0x01
    blob.upload_from_string(bytes(raw))
    with pytest.raises(ShardCorrupt, match="base step 10"):
        verify_following_refs(rig.gcs, JOB, 20, 0)
    assert 10 in rig.gcs.complete_steps(JOB)  # a read-only check quarantines nothing

    cfg = config(shm_dir / "ram-g", rig.pvc_dir, rig.gcs_cfg)
    cfg = cfg.model_copy(
        update={"restore": cfg.restore.model_copy(update={"order": ("gcs", "pvc")})}
    )
    fresh = LoraTrainer()
    with Checkpointer(cfg, rank=0, world_size=1) as c2:
        res = c2.restore(fresh.state)
    assert res.step == 20 and res.tiers == {0: "pvc"}, res
    assert same(fresh.weights(), w[20])
    assert any(n.startswith("gcs:") and "base step 10" in n for n in res.skipped), res.skipped
    assert 10 not in rig.gcs.complete_steps(JOB)  # the corrupt base was quarantined
