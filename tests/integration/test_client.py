"""The training client on real tmpfs / directories / fake-gcs-server (C-01 .. C-05, bad input)."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import strata
from strata.client import Checkpointer, RestoreError
from strata.config import StrataConfig
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.records import commit_if_complete
from strata.tiers.slots import SLOT_ALIGN, slots_dir
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.leases import lease_holder

pytestmark = pytest.mark.integration
JOB = "ns.train"


class Trainer:
    """A tiny real training setup whose state is what users checkpoint."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.state: dict[str, Any] = {
            "model": self.model,
            "optim": self.opt,
            "step": 0,
            "rng": torch.get_rng_state(),
            "loader": {"epoch": 0, "offset": 0, "perm": np.arange(5)},
            "py_rng": random.getstate(),
        }

    def train(self, step: int) -> None:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(4, 8, generator=g)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.state["step"] = step
        self.state["loader"]["offset"] = step * 4

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def ckpt(shm: Path, tmp: Path | None = None, **kw: Any) -> Checkpointer:
    return Checkpointer(
        job_id=JOB,
        ram_dir=shm / "ram",
        pvc_dir=None if tmp is None else tmp / "pvc",
        rank=0,
        world_size=1,
        **kw,
    )


def promote(c: Checkpointer, step: int, tier: PosixTier | GcsTier) -> None:
    """What the sidecar does: copy a checksummed RAM shard to another tier (under a lease)."""
    from strata.tiers.slots import SlotLease

    c.wait()
    with SlotLease(c.ram, JOB, step, 0) as lease:
        assert lease.manifest is not None and lease.manifest.verified
        tier.put_shard(JOB, step, 0, lease.path, lease.manifest)
    # ... and, every rank's shard being there, the step's global commit record (issue 12).
    assert commit_if_complete(tier, JOB, step, "test") is not None


def test_save_restore_in_place_keeps_identity(shm_dir: Path) -> None:
    t = Trainer()
    with ckpt(shm_dir) as c:
        for s in range(3):
            t.train(s)
            assert c.save(s, t.state)
        saved = t.weights()
        c.wait()
    t2 = Trainer(seed=1)
    params = list(t2.model.parameters())
    with ckpt(shm_dir) as c2:
        res = c2.restore(t2.state)
    assert (res.step, res.tiers, res.next_step) == (2, {0: "ram"}, 3)
    assert res.nbytes > 0 and res.seconds >= 0
    assert all(p is q for p, q in zip(params, t2.model.parameters(), strict=True))
    assert same_weights(t2.weights(), saved)
    assert t2.state["step"] == 2 and t2.state["loader"]["offset"] == 8
    assert torch.equal(
        t2.opt.state[params[0]]["exp_avg"], t.opt.state[next(iter(t.model.parameters()))]["exp_avg"]
    )
    # training continues identically after the restore
    t.train(3)
    t2.train(3)
    assert same_weights(t.weights(), t2.weights())


def test_c01_mutation_after_save_returns_does_not_leak_into_the_checkpoint(shm_dir: Path) -> None:
    """C-01: save() returns only after its snapshot; in-place changes right after do not count."""
    t = Trainer()
    big = torch.randn(256, 1024)  # 1 MiB: the checksum pass is still running when we mutate
    t.state["big"] = big
    with ckpt(shm_dir) as c:
        t.train(0)
        expected = t.weights()
        expected_big = big.clone()
        assert c.save(7, t.state)
        with torch.no_grad():
            for p in t.model.parameters():
                p.add_(1.0)
            big.mul_(-1)
        c.wait()
        res = c.restore(t.state)
    assert res.step == 7
    assert same_weights(t.weights(), expected)
    assert torch.equal(big, expected_big)


def test_c02_kill_while_next_step_half_written_restores_previous(shm_dir: Path) -> None:
    """C-02: keep=1; step N+1 half written (data linked, no manifest): restore gives N, and
    pruning of N only happens once a newer step is committed."""
    t = Trainer()
    with ckpt(shm_dir, keep=1) as c:
        t.train(0)
        assert c.save(10, t.state)
        w10 = t.weights()
        c.wait()
        # a writer killed mid-save of step 11: its slot linked as data, the manifest never written
        free = next(p for p in slots_dir(c.ram.root, JOB, 0).iterdir() if os.stat(p).st_nlink == 1)
        c.ram.step_dir(JOB, 11).mkdir(parents=True)
        os.link(free, c.ram.data_path(JOB, 11, 0))
        t.train(1)
        res = c.restore(t.state)
        assert res.step == 10 and same_weights(t.weights(), w10)
        assert any("step 11 has data without a manifest" in n for n in res.skipped)
        assert c.save(12, t.state)  # reuses the half-written step's slot, keeps step 10
        assert sorted(c.ram.list_steps(JOB)) == [10, 12]


def test_c03_step_without_manifest_is_skipped_in_ram_and_pvc(
    shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = Trainer()
    pvc = PosixTier(tmp_path / "pvc")
    with ckpt(shm_dir, tmp_path) as c:
        t.train(0)
        c.save(20, t.state)
        w20 = t.weights()
        promote(c, 20, pvc)
        t.train(1)
        c.save(30, t.state)
        promote(c, 30, pvc)
        c.ram.manifest_path(JOB, 30, 0).unlink()
        pvc.manifest_path(JOB, 30, 0).unlink()
        with caplog.at_level(logging.WARNING, logger="strata.client"):
            res = c.restore(t.state)
    assert res.step == 20 and same_weights(t.weights(), w20)
    assert {n.split(":")[0] for n in res.skipped if "step 30 has data without a manifest" in n} == {
        "ram",
        "pvc",
    }
    assert "step 30 has data without a manifest" in caplog.text


def test_c04_flipped_bytes_fall_back_ram_pvc_gcs_and_quarantine_once(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    """C-04: flipped bytes in RAM -> PVC (loaded where it lies: nothing re-staged into RAM);
    flipped on the PVC too -> GCS (staged into RAM); bad copies quarantined and never retried
    (the next restore is a RAM hit of the staged copy)."""
    gcs_cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt")
    config = StrataConfig(
        job_id=JOB,
        ram={"path": str(shm_dir / "ram")},
        pvc={"path": str(tmp_path / "pvc")},
        gcs=gcs_cfg,
    )
    t = Trainer()
    pvc = PosixTier(tmp_path / "pvc")
    with (
        Checkpointer(config, rank=0, world_size=1) as c,
        GcsTier(gcs_cfg, client=gcs_emulator.client()) as gcs,
    ):
        t.train(0)
        c.save(40, t.state)
        w40 = t.weights()
        promote(c, 40, pvc)
        promote(c, 40, gcs)

        def flip(p: Path) -> None:
            raw = bytearray(p.read_bytes())
            raw[100] ^= 0x10
            p.write_bytes(bytes(raw))

        flip(c.ram.data_path(JOB, 40, 0))
        t.train(1)
        res = c.restore(t.state)
        assert res.step == 40 and res.tiers == {0: "pvc"} and same_weights(t.weights(), w40)
        assert any(
            n.startswith("ram:") and "CRC32C mismatch" in n and "quarantined" in n
            for n in res.skipped
        )
        assert any(".quarantined-" in n for n in os.listdir(c.ram.step_dir(JOB, 40)))

        assert 40 not in c.ram.complete_steps(JOB)  # the PVC copy was read in place
        flip(pvc.data_path(JOB, 40, 0))  # the PVC copy goes bad too
        t.train(2)
        res = c.restore(t.state)
        assert res.step == 40 and res.tiers == {0: "gcs"} and same_weights(t.weights(), w40)
        assert any(n.startswith("pvc:") and "quarantined" in n for n in res.skipped)
        assert 40 not in pvc.list_steps(JOB) or not pvc.list_steps(JOB)[40].committed_ranks

        t.train(3)
        res = c.restore(t.state)  # healed: RAM holds a verified copy; nothing re-quarantined
        assert res.tiers == {0: "ram"} and res.skipped == [] and same_weights(t.weights(), w40)


def test_c05_saving_while_a_step_is_being_promoted(shm_dir: Path, tmp_path: Path) -> None:
    """C-05: a promoter in another process holds step N; the trainer saves N+1.. meanwhile; the
    PVC copy of N matches N's checksums and N's values; nothing hangs."""
    t = Trainer()
    pvc = PosixTier(tmp_path / "pvc")
    with ckpt(shm_dir, tmp_path, keep=1) as c:
        t.train(0)
        assert c.save(50, t.state)
        w50 = t.weights()
        c.wait()
        with lease_holder(c.ram.root, JOB, 50, 0):
            for s in range(51, 56):
                t.train(s)
                assert c.save(s, t.state), c.last_error
            c.wait()
            promote(c, 50, pvc)  # the N copy is intact although 5 saves happened meanwhile
        pvc.verify_file(pvc.data_path(JOB, 50, 0), pvc.get_manifest(JOB, 50, 0))
        w55 = t.weights()
    shutil_rm(shm_dir / "ram")
    t2 = Trainer(seed=3)
    with ckpt(shm_dir, tmp_path) as c2:
        res = c2.restore(t2.state)
    assert res.step == 50 and res.tiers == {0: "pvc"} and same_weights(t2.weights(), w50)
    assert not same_weights(w50, w55)


def shutil_rm(p: Path) -> None:
    import shutil

    shutil.rmtree(p)


def test_enospc_in_ram_fails_the_save_not_training(
    small_tmpfs: Callable[[int], Path], caplog: pytest.LogCaptureFixture
) -> None:
    root = small_tmpfs(3 * SLOT_ALIGN)
    t = Trainer()
    with Checkpointer(job_id=JOB, ram_dir=root, rank=0, world_size=1) as c:
        assert c.save(1, t.state)
        w1 = t.weights()
        t.state["huge"] = torch.zeros(2 * SLOT_ALIGN // 4)  # a slot of 3 MiB cannot be allocated
        with caplog.at_level(logging.ERROR, logger="strata.client"):
            assert c.save(2, t.state) is False
        assert "no space left on the RAM tier" in (c.last_error or "") and c.failed_saves == 1
        assert "training continues" in caplog.text
        del t.state["huge"]
        t.train(5)
        res = c.restore(t.state)
    assert res.step == 1 and same_weights(t.weights(), w1)


def test_unsupported_value_fails_the_save_with_its_path(shm_dir: Path) -> None:
    t = Trainer()
    t.state["loader"]["sampler"] = object()
    with ckpt(shm_dir) as c:
        assert c.save(1, t.state) is False
        assert "state['loader']['sampler']" in (c.last_error or "")
        with pytest.raises(ValueError, match="non-negative int"):
            c.save(-1, t.state)
    with ckpt(shm_dir, raise_on_error=True) as c, pytest.raises(TypeError, match="sampler"):
        c.save(1, t.state)


@pytest.mark.parametrize(
    ("patch", "why"),
    [
        ({"job_id": "other.job"}, "manifest of job 'other.job'"),
        ({"world_size": 2}, "world size 2"),
        ({"format_version": 3}, "format version 3"),
    ],
)
def test_foreign_manifest_on_pvc_is_rejected_and_falls_back(
    shm_dir: Path, tmp_path: Path, patch: dict[str, Any], why: str
) -> None:
    t = Trainer()
    pvc = PosixTier(tmp_path / "pvc")
    with ckpt(shm_dir, tmp_path) as c:
        t.train(0)
        c.save(60, t.state)
        w60 = t.weights()
        t.train(1)
        c.save(70, t.state)
        promote(c, 70, pvc)
    shutil_rm(shm_dir / "ram" / JOB / "steps" / "000000000070")
    m = pvc.get_manifest(JOB, 70, 0)
    pvc.manifest_path(JOB, 70, 0).write_bytes(m.model_copy(update=patch).to_json())
    t.train(2)
    with ckpt(shm_dir, tmp_path) as c:
        res = c.restore(t.state)
    assert res.step == 60 and same_weights(t.weights(), w60)
    assert any(n.startswith("pvc: step 70") and why in n for n in res.skipped), res.skipped
    assert pvc.manifest_path(JOB, 70, 0).exists()  # not ours to quarantine or delete


def test_nothing_restorable_raises_or_starts_fresh_loudly(
    shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = Trainer()
    with (
        ckpt(shm_dir, tmp_path) as c,
        pytest.raises(RestoreError, match=r"searched ram=.*ram, pvc=.*pvc.*allowFreshStart"),
    ):
        c.restore(t.state)
    before = t.weights()
    with ckpt(shm_dir, tmp_path, allow_fresh_start=True) as c, caplog.at_level(logging.WARNING):
        res = c.restore(t.state)
    assert res.fresh_start and res.step is None and res.next_step == 0
    assert "NO restorable checkpoint" in caplog.text
    assert same_weights(t.weights(), before)


def test_should_save_and_lazy_export(shm_dir: Path) -> None:
    assert strata.Checkpointer is Checkpointer
    with ckpt(shm_dir, every_steps=10) as c:
        assert [s for s in range(35) if c.should_save(s)] == [0, 10, 20, 30]


def test_config_from_environment(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "STRATA_CONFIG",
        StrataConfig(
            job_id="ns.envjob", ram={"path": str(shm_dir / "r"), "keep": 2}
        ).model_dump_json(),
    )
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with Checkpointer() as c:
        assert (c.job_id, c.rank, c.world_size, c.config.ram.keep) == ("ns.envjob", 1, 3, 2)
        assert c.save(0, {"x": torch.ones(3)})
        assert c.ram.get_manifest("ns.envjob", 0, 1).world_size == 3


def test_unlistable_tier_is_noted_and_others_serve(shm_dir: Path, tmp_path: Path) -> None:
    """A PVC that cannot be listed (here its steps folder is a file) does not block a RAM restore."""
    t = Trainer()
    (tmp_path / "pvc" / JOB).mkdir(parents=True)
    (tmp_path / "pvc" / JOB / "steps").write_text("not a directory")
    with ckpt(shm_dir, tmp_path) as c:
        t.train(0)
        assert c.save(3, t.state)
        w3 = t.weights()
        t.train(1)
        res = c.restore(t.state)
    assert res.step == 3 and res.tiers == {0: "ram"} and same_weights(t.weights(), w3)
    assert any(n.startswith("pvc: not searched: cannot list") for n in res.skipped), res.skipped


def test_environment_and_arguments_are_merged_and_a_bad_setting_is_never_dropped(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arguments override the environment; they never silently discard it (a dropped
    STRATA_PVC_DIR would mean checkpoints thought durable are not)."""
    monkeypatch.setenv("STRATA_PVC_DIR", str(tmp_path / "pvc"))
    monkeypatch.setenv("STRATA_CONFIG", '{"restore": {"allow_fresh_start": true}}')
    ckpt = Checkpointer(job_id="ns.merge", ram_dir=shm_dir)
    try:
        assert ckpt.config.pvc is not None and ckpt.config.pvc.path == str(tmp_path / "pvc")
        assert ckpt.config.restore.allow_fresh_start is True
    finally:
        ckpt.close()
    monkeypatch.setenv("STRATA_CONFIG", '{"job_id": "x", "bogus": 1}')
    with pytest.raises(strata.ConfigError, match="bogus"):
        Checkpointer(job_id="ns.merge", ram_dir=shm_dir)
    monkeypatch.setenv("STRATA_CONFIG", "{not json")
    with pytest.raises(strata.ConfigError, match="STRATA_CONFIG is not valid JSON"):
        Checkpointer(job_id="ns.merge", ram_dir=shm_dir)


def test_a_gcs_tier_without_credentials_does_not_stop_a_restore_that_ram_serves(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No credentials anywhere, and never the GCE metadata server (loopback only in tests).
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    config = StrataConfig.parse(
        {"job_id": "ns.nocreds", "ram": {"path": str(shm_dir)}, "gcs": {"bucket": "my-bucket"}}
    )
    with Checkpointer(config) as ckpt:
        assert ckpt.save(1, {"x": torch.arange(4.0)})
    target = {"x": torch.zeros(4)}
    with Checkpointer(config) as ckpt:
        result = ckpt.restore(target)
    assert (result.step, result.tier) == (1, "ram")
    assert torch.equal(target["x"], torch.arange(4.0))
    assert any(
        n.startswith("gcs: not searched: no Google Cloud credentials") for n in result.skipped
    )


def test_a_process_that_never_restored_joins_the_nodes_incarnation_or_is_refused(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A first process restores (a fresh start: it opens an incarnation, its record in RAM).
    A second one saves without restoring: its step is stamped with that incarnation (the one
    the sidecar promotes), not with none. A third, at another world size, is refused: False,
    last_error and the log say why, and nothing is committed."""
    t = Trainer()
    with ckpt(shm_dir, allow_fresh_start=True) as first:
        first.restore(t.state)  # fresh start, opens an incarnation
        t.train(1)
        assert first.save(1, t.state)
        first.wait()
        opened = first.incarnation
    assert opened
    with ckpt(shm_dir) as second, caplog.at_level(logging.WARNING):
        assert second.save(2, t.state)
        second.wait()
        assert second.ram.get_manifest(JOB, 2, 0).incarnation == opened
        assert f"joining incarnation {opened}" in caplog.text
    other = Checkpointer(job_id=JOB, ram_dir=shm_dir / "ram", rank=1, world_size=2)
    with other, caplog.at_level(logging.ERROR):
        assert other.save(3, t.state) is False
        assert other.last_error is not None and "never called restore()" in other.last_error
        assert "Strata: step 3" in caplog.text
        assert other.saver.outcomes.failed_saves == 1
        assert 3 not in other.ram.list_steps(JOB)
