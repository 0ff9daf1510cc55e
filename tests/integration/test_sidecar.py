"""``strata sidecar`` as a real process: real /dev/shm RAM tier, a PVC directory, fake-gcs-server.

Covers start-up pruning (C-12), staging with corrupted nearer copies (C-04), the SIGTERM flush
(C-14), SIGKILL during promotion, reports over HTTPS with a bearer token, the /metrics endpoint
parsed with prometheus_client, restore of a recreated pod through the sidecar (C-06), bad
configuration (exit 2 naming the setting), the RAM size limit of the slots API, the janitor.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.client.sidecar_client import SidecarClient, connect
from strata.config import StrataConfig
from strata.errors import SidecarUnavailable, SlotsBusy, StageError, TierError, TierFull
from strata.format.incarnation import Incarnation
from strata.protocol import StageRequest
from strata.reports import REPORT_PATH, SidecarReport
from strata.sidecar.janitor import HEARTBEAT_NAME
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import commit_if_complete, write_incarnation
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import (
    ReportReceiver,
    SidecarProcess,
    flip_byte,
    free_port,
    write_ram_shard,
)

pytestmark = pytest.mark.integration

JOB = "ns.train"
Start = Callable[..., SidecarProcess]


def payload(step: int, rank: int = 0, n: int = 40_000) -> bytes:
    return (f"<{step}:{rank}>".encode() * (n // 6 + 1))[:n]


def config_for(ram_dir: Path, pvc_dir: Path | None = None, **extra: Any) -> StrataConfig:
    raw: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(ram_dir), "every": {"steps": 10}, "keep": 1},
        "metrics_port": free_port(),
        "metrics_host": "127.0.0.1",
        "writer_id": "pod-a",
        "termination_grace_seconds": 30,
    }
    if pvc_dir is not None:
        raw["pvc"] = {"path": str(pvc_dir), "every": {"steps": 50}, "keep": 2}
    for key, value in extra.items():
        raw[key] = value
    return StrataConfig.parse(raw)


def wait_until(
    predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def committed_bytes(tier: PosixTier, step: int, rank: int = 0) -> bytes:
    m = tier.get_manifest(JOB, step, rank)
    tier.verify_file(tier.data_path(JOB, step, rank), m)
    return tier.data_path(JOB, step, rank).read_bytes()[: m.data_nbytes]


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- start-up ----------------------------------------------------------------------------------------


def test_c12_start_up_prunes_ram_to_the_newest_committed_step_before_becoming_ready(
    shm_dir: Path, sidecar_proc: Start
) -> None:
    ram = RamTier(shm_dir, keep=1)
    for step in (10, 20):
        write_ram_shard(ram, JOB, step, 0, payload(step))
    # A save killed half-way (data linked, no manifest) and a stray temporary manifest (C-12).
    write_ram_shard(ram, JOB, 30, 0, payload(30), verified=False)
    ram.manifest_path(JOB, 30, 0).unlink()
    (ram.step_dir(JOB, 20) / "rank-00000.manifest.tmp-1-abc").write_bytes(b"{")
    # Another job's data in the same (hostPath) RAM directory must not be touched.
    other = RamTier(shm_dir, keep=1)
    write_ram_shard(other, "ns.other", 5, 0, payload(5))
    write_ram_shard(other, "ns.other", 6, 0, payload(6))

    side = sidecar_proc(config_for(shm_dir))
    assert sorted(ram.list_steps(JOB)) == [20]
    assert committed_bytes(ram, 20) == payload(20)
    assert not list(ram.step_dir(JOB, 20).glob("*.tmp-*"))
    assert sorted(ram.list_steps("ns.other")) == [5, 6]
    assert (shm_dir / JOB / HEARTBEAT_NAME).exists()
    events = [e.get("event") for e in side.log_events()]
    assert events.index("ram_pruned") < events.index("ready")


def test_start_up_prefetches_the_newest_durable_step_for_ranks_the_ram_tier_knows(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """A sidecar restarted on the same node (hostPath, or a container restart) finds rank 0's
    slot ring holding step 10 while the PVC holds step 50: it stages 50 into RAM by itself."""
    ram, pvc = RamTier(shm_dir, keep=1), PosixTier(tmp_path / "pvc")
    write_ram_shard(ram, JOB, 10, 0, payload(10))
    staging = RamTier(tmp_path / "staging", keep=1)
    m = write_ram_shard(staging, JOB, 50, 0, payload(50))
    pvc.put_shard(JOB, 50, 0, staging.data_path(JOB, 50, 0), m)
    assert commit_if_complete(pvc, JOB, 50, "test") is not None
    side = sidecar_proc(config_for(shm_dir, tmp_path / "pvc"))
    wait_until(  # committed, not merely listed (the data is linked before the manifest)
        lambda: 50 in ram.complete_steps(JOB), what="step 50 prefetched into RAM"
    )
    assert committed_bytes(ram, 50) == payload(50)
    wait_until(lambda: any(e.get("event") == "prefetched" for e in side.log_events()), what="log")


def test_start_up_prefetch_takes_the_newest_eligible_step_as_the_restore_would(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """The PVC holds incarnation X's steps 10 and 30 (committed) and 40 (every shard there, no
    commit record: its commit never happened); the job restored step 10 since (incarnation Y),
    so 30 is superseded. The prefetch stages 10, the step a restore picks, not 30 nor 40. The
    previous prefetch took the newest step complete by its manifests (40)."""
    x = Incarnation(job_id=JOB, id="20260101T000000000000Z-aaaaaaaa", world_size=1)
    y = Incarnation(
        job_id=JOB, id="20260102T000000000000Z-bbbbbbbb", parent=x.id, base_step=10, world_size=1
    )
    ram, pvc = RamTier(shm_dir, keep=1), PosixTier(tmp_path / "pvc")
    m = write_ram_shard(ram, JOB, 5, 0, payload(5))
    ram.write_manifest(JOB, 5, 0, m.model_copy(update={"incarnation": x.id}))
    staging = RamTier(tmp_path / "staging", keep=1)
    for step in (10, 30, 40):
        m = write_ram_shard(staging, JOB, step, 0, payload(step))
        m = m.model_copy(update={"incarnation": x.id})
        pvc.put_shard(JOB, step, 0, staging.data_path(JOB, step, 0), m)
        if step != 40:
            assert commit_if_complete(pvc, JOB, step, "test", records=[x]) is not None
    write_incarnation(pvc, y)
    side = sidecar_proc(config_for(shm_dir, tmp_path / "pvc"))
    wait_until(
        lambda: any(e.get("event") == "prefetch-done" for e in side.log_events()),
        what="the start-up prefetch to finish",
    )
    staged = [e.get("step") for e in side.log_events() if e.get("event") == "prefetched"]
    assert staged == [10]
    assert 10 in ram.complete_steps(JOB) and committed_bytes(ram, 10) == payload(10)
    assert not {30, 40} & set(ram.list_steps(JOB))


def run_sidecar_once(
    env: dict[str, str], config: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """``strata sidecar`` with ``config`` as STRATA_CONFIG, expected to exit at start-up."""
    return subprocess.run(
        [sys.executable, "-m", "strata.cli", "sidecar"],
        env={**env, "STRATA_CONFIG": json.dumps(config)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_configuration_exits_2_naming_the_setting(shm_dir: Path, sidecar_proc: Start) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    for config, words in (
        ({"job_id": JOB, "ram": {"path": str(shm_dir), "keep": 0}}, "ram.keep"),
        ({"job_id": JOB, "ram": {"path": str(shm_dir)}, "colour": "red"}, "colour"),
        (
            {
                "job_id": JOB,
                "ram": {"path": str(shm_dir), "every": {"steps": 10}},
                "pvc": {"path": str(shm_dir / "p"), "every": {"steps": 15}},
            },
            "pvc.every.steps=15",
        ),
    ):
        proc = run_sidecar_once(env, config)
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr


def test_an_unusable_environment_stops_the_sidecar_with_one_clear_line(tmp_path: Path) -> None:
    """RAM directory unusable, metrics port taken: exit 1 with what is wrong, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = (
            (
                {"job_id": JOB, "ram": {"path": str(not_a_dir)}, "metrics_port": 0},
                "Not a directory",
            ),
            (
                {
                    "job_id": JOB,
                    "ram": {"path": str(tmp_path / "ram")},
                    "metrics_port": port,
                    "metrics_host": "127.0.0.1",
                },
                "metrics_port is taken",
            ),
        )
        for config, words in cases:
            proc = run_sidecar_once(env, config)
            assert proc.returncode == 1, proc.stderr
            assert "strata sidecar: cannot start:" in proc.stderr and words in proc.stderr
            assert "Traceback" not in proc.stderr


# -- staging (C-04) and restore of a recreated pod (C-06) ---------------------------------------------


@pytest.fixture
def three_tiers(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> tuple[StrataConfig, RamTier, PosixTier, GcsTier]:
    gcs_cfg = gcs_emulator.tier_config(gcs_bucket, every={"steps": 100}, keep=2)
    config = config_for(shm_dir, tmp_path / "pvc", gcs=gcs_cfg.model_dump(mode="json"))
    ram = RamTier(shm_dir, keep=1)
    pvc = PosixTier(tmp_path / "pvc")
    gcs = GcsTier(gcs_cfg, writer_id="pod-a", client=gcs_emulator.client())
    return config, ram, pvc, gcs


def put_everywhere(ram: RamTier, pvc: PosixTier, gcs: GcsTier, step: int) -> None:
    m = write_ram_shard(ram, JOB, step, 0, payload(step))
    pvc.put_shard(JOB, step, 0, ram.data_path(JOB, step, 0), m)
    gcs.put_shard(JOB, step, 0, ram.data_path(JOB, step, 0), m)


def test_c04_staging_falls_back_past_corrupt_copies_and_quarantines_them(
    three_tiers: tuple[StrataConfig, RamTier, PosixTier, GcsTier], sidecar_proc: Start
) -> None:
    config, ram, pvc, gcs = three_tiers
    put_everywhere(ram, pvc, gcs, 100)
    side = sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    # The start-up prefetch (a background stager of its own) must not race the stagings below:
    # seeing RAM without step 100 mid-way, it re-staged it after a byte was flipped.
    wait_until(
        lambda: any(e.get("event") == "prefetch-done" for e in side.log_events()),
        what="the start-up prefetch to finish",
    )

    # 1. RAM hit.
    res = sidecar_api.stage(StageRequest(job_id=JOB, step=100, rank=0, world_size=1))
    assert res.tier == "ram" and res.path.read_bytes()[: res.nbytes] == payload(100)
    # 2. RAM copy corrupt -> PVC serves, RAM copy quarantined.
    flip_byte(ram.data_path(JOB, 100, 0))
    res = sidecar_api.stage(StageRequest(job_id=JOB, step=100, rank=0, world_size=1))
    assert res.tier == "pvc"
    assert any(s.startswith("ram:") and "quarantined" in s for s in res.skipped)
    assert res.path.read_bytes()[: res.nbytes] == payload(100)
    # 3. RAM (restaged copy) and PVC corrupt -> GCS serves.
    flip_byte(ram.data_path(JOB, 100, 0))
    flip_byte(pvc.data_path(JOB, 100, 0))
    res = sidecar_api.stage(StageRequest(job_id=JOB, step=100, rank=0, world_size=1))
    assert res.tier == "gcs"
    assert [s.split(":")[0] for s in res.skipped if "quarantined" in s] == ["ram", "pvc"]
    assert res.path.read_bytes()[: res.nbytes] == payload(100)
    assert ram.data_path(JOB, 100, 0).read_bytes()[: res.nbytes] == payload(100)
    # The bad PVC copy is never retried: it is no longer committed.
    listing = pvc.list_steps(JOB).get(100)
    assert listing is None or 0 not in listing.committed_ranks
    samples = metric_samples(side.scrape())
    assert samples[("strata_checksum_mismatches_total", (("tier", "ram"),))] == 2
    assert samples[("strata_checksum_mismatches_total", (("tier", "pvc"),))] == 1
    assert samples[("strata_stage_total", (("outcome", "staged"), ("tier", "gcs")))] == 1
    assert samples[("strata_stage_total", (("outcome", "staged"), ("tier", "pvc")))] == 1


def test_c06_recreated_pod_restores_from_the_pvc_through_the_sidecar(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    torch = pytest.importorskip("torch")
    from strata.client import Checkpointer

    pvc_root = tmp_path / "pvc"
    config = config_for(shm_dir, pvc_root)
    side = sidecar_proc(config)
    model = torch.nn.Linear(8, 4)
    state = {"model": model.state_dict(), "step": 0}
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        assert isinstance(
            getattr(ckpt.stager, "sidecar", None), SidecarClient
        )  # auto-detected sidecar
        state["step"] = 50
        assert ckpt.save(50, state)
        ckpt.wait()
    wait_until(lambda: 50 in PosixTier(pvc_root).complete_steps(JOB), what="step 50 on the PVC")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    side.kill()

    # The pod is recreated: empty RAM tier, a new sidecar; only the PVC holds step 50.
    for child in shm_dir.iterdir():
        subprocess.run(["rm", "-rf", str(child)], check=True)
    side2 = sidecar_proc(config)
    fresh = torch.nn.Linear(8, 4)
    target = {"model": fresh.state_dict(), "step": -1}
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        assert isinstance(getattr(ckpt.stager, "sidecar", None), SidecarClient)
        result = ckpt.restore(target)
    assert result.step == 50 and result.tier == "pvc"
    assert target["step"] == 50
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k])
    wait_until(
        lambda: (
            metric_samples(side2.scrape()).get(
                ("strata_restore_total", (("outcome", "restored"), ("tier", "pvc")))
            )
            == 1
        ),
        what="restore counted",
    )


def test_a_ram_hit_through_the_sidecar_is_verified_once_by_the_trainers_load(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """Issue 14: asked to, the sidecar leaves a RAM hit's verification to the trainer's one-pass
    load (instead of a checksum pass in the sidecar, then the trainer's copy); a corrupt RAM
    copy is still caught, by the load, quarantined, and the restore falls to the PVC."""
    torch = pytest.importorskip("torch")
    from strata.client import Checkpointer

    pvc_root = tmp_path / "pvc"
    config = config_for(shm_dir, pvc_root)
    side = sidecar_proc(config)
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(3 * 1024 * 1024 // 4 + 7, generator=g),
        "b": torch.randn(33, generator=g),
        "step": 50,
    }
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        assert ckpt.save(50, state)
        ckpt.wait()
    wait_until(lambda: 50 in PosixTier(pvc_root).complete_steps(JOB), what="step 50 on the PVC")
    api = connect(config.socket)
    assert api is not None
    verified = StageRequest(job_id=JOB, step=50, rank=0, world_size=1)
    deferred = verified.model_copy(update={"verify_in_place": False})
    res = api.stage(deferred)
    assert res.tier == "ram" and res.deferred_verify
    assert not api.stage(verified).deferred_verify  # by default the sidecar verifies

    # A flipped byte in RAM: asked to defer, the sidecar serves the copy unverified ...
    flip_byte(RamTier(shm_dir).data_path(JOB, 50, 0), 2 * 1024 * 1024)
    res = api.stage(deferred)
    assert res.tier == "ram" and res.deferred_verify and not res.quarantined
    # ... and the trainer's load catches it, quarantines it and restores from the PVC.
    target = {"w": torch.zeros_like(state["w"]), "b": torch.zeros(33), "step": -1}
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        assert isinstance(getattr(ckpt.stager, "sidecar", None), SidecarClient)
        result = ckpt.restore(target)
    assert result.step == 50 and result.tier == "pvc"
    assert any(n.startswith("ram:") and "quarantined" in n for n in result.skipped)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["step"] == 50
    # The sidecar counts the mismatch the trainer found, as for those its staging finds.
    wait_until(
        lambda: (
            metric_samples(side.scrape()).get(
                ("strata_checksum_mismatches_total", (("tier", "ram"),))
            )
            == 1
        ),
        what="the trainer's mismatch counted by the sidecar",
    )


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "flipped-byte"])
def test_a_deferred_ram_hit_loads_and_verifies_with_the_sidecar_killed_after_its_reply(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start, corrupt: bool
) -> None:
    """Issue 14, one-pass RAM hit: the sidecar answers the stage without verifying the copy and
    is SIGKILLed right after its reply, before the trainer's load. The load needs nothing more
    from it: an intact copy restores bit for bit from RAM; a corrupt one is still caught by the
    load, quarantined, and the restore re-plans through the direct tiers (the sidecar being
    gone) and restores from the PVC."""
    torch = pytest.importorskip("torch")
    from strata.client import Checkpointer

    pvc_root = tmp_path / "pvc"
    config = config_for(shm_dir, pvc_root)
    side = sidecar_proc(config)
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(3 * 1024 * 1024 // 4 + 3, generator=g), "step": 60}
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        assert ckpt.save(60, state)
        ckpt.wait()
    wait_until(lambda: 60 in PosixTier(pvc_root).complete_steps(JOB), what="step 60 on the PVC")
    if corrupt:
        flip_byte(RamTier(shm_dir).data_path(JOB, 60, 0), 1024 * 1024 + 5)
    target = {"w": torch.zeros_like(state["w"]), "step": -1}
    replies: list[Any] = []
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        stager = ckpt.stager
        assert isinstance(getattr(stager, "sidecar", None), SidecarClient)
        stager.wait_seconds = 0.5  # type: ignore[attr-defined]
        served = stager.sidecar.stage  # type: ignore[attr-defined]

        def stage_then_kill(*args: Any, **kwargs: Any) -> Any:
            res = served(*args, **kwargs)
            replies.append(res)
            side.kill()  # after the reply, before the trainer's load
            return res

        stager.sidecar.stage = stage_then_kill  # type: ignore[attr-defined]
        result = ckpt.restore(target)
    assert side.proc.poll() is not None
    assert [(r.tier, r.deferred_verify) for r in replies] == [("ram", True)]
    assert torch.equal(target["w"], state["w"]) and target["step"] == 60
    if corrupt:
        assert result.step == 60 and result.tier == "pvc"
        assert any(n.startswith("ram:") and "quarantined" in n for n in result.skipped)
        assert any("read the tiers directly" in n for n in result.skipped)
        ram = RamTier(shm_dir)
        step_dir = ram.data_path(JOB, 60, 0).parent
        assert list(step_dir.glob("rank-00000.manifest.quarantined-*"))  # the record stays
        # loaded where it lies on the PVC (one read, no copy into RAM first): nothing of step
        # 60 is committed in RAM until the next save, and the PVC copy stays served
        assert 60 not in ram.complete_steps(JOB)
        again = {"w": torch.zeros_like(state["w"]), "step": -1}
        with Checkpointer(config, rank=0, world_size=1) as ckpt:
            second = ckpt.restore(again)
        assert (second.step, second.tier) == (60, "pvc") and torch.equal(again["w"], state["w"])
    else:
        assert result.step == 60 and result.tier == "ram"


def _saved_step_7(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> tuple[StrataConfig, Any, dict[str, Any]]:
    """A sidecar with a PVC, and step 7 of a 4,096-float state saved through it."""
    import torch

    from strata.client import Checkpointer

    config = config_for(shm_dir, tmp_path / "pvc")
    side = sidecar_proc(config)
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 7}
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        assert ckpt.save(7, state)
        ckpt.wait()
    return config, side, state


def test_a_restore_whose_sidecar_is_gone_waits_for_it_once_not_once_per_call(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """The sidecar is SIGKILLed after the trainer connected and not restarted: the restore's
    inventory waits ``wait_seconds`` for it, then reads the tiers directly; its staging does
    not wait again (the sidecar still does not answer) and says so. Before, every call waited
    (10 s each by default: 20 s for a one-round restore)."""
    torch = pytest.importorskip("torch")
    from strata.client import Checkpointer

    config, side, state = _saved_step_7(shm_dir, tmp_path, sidecar_proc)
    target = {"w": torch.zeros(4096), "step": -1}
    with Checkpointer(config, rank=0, world_size=1) as ckpt:
        stager = ckpt.stager
        assert isinstance(getattr(stager, "sidecar", None), SidecarClient)
        stager.wait_seconds = 0.5  # type: ignore[attr-defined]
        side.kill()
        result = ckpt.restore(target)
    assert result.step == 7 and torch.equal(target["w"], state["w"])
    waited = [n for n in result.skipped if "waited" in n and "read the tiers directly" in n]
    again = [n for n in result.skipped if "still not answering" in n]
    assert len(waited) == 1 and "inventory" in waited[0], result.skipped
    assert len(again) == 1 and "staging of step 7" in again[0], result.skipped


def test_a_sidecar_that_dies_mid_answer_is_a_gone_sidecar_not_a_crashed_restore(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """The sidecar is SIGKILLed while it sends the inventory's answer: the trainer's restore
    reads the tiers directly (noted), as for a sidecar that does not answer at all. Found by
    ``make chaos``: ``http.client.IncompleteRead`` (219,264 of 231,325 bytes) escaped
    ``restore()`` and killed the trainer. The dying sidecar here is a real socket on the real
    path that answers every request with a response cut short and closes it."""
    import threading

    torch = pytest.importorskip("torch")
    from strata.client import Checkpointer

    config, side, state = _saved_step_7(shm_dir, tmp_path, sidecar_proc)
    cut = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"ra'
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(cut)

    target = {"w": torch.zeros(4096), "step": -1}
    try:
        with Checkpointer(config, rank=0, world_size=1) as ckpt:
            stager = ckpt.stager
            assert isinstance(getattr(stager, "sidecar", None), SidecarClient)
            stager.wait_seconds = 0.5  # type: ignore[attr-defined]
            side.kill()
            side.proc.wait(timeout=30)
            Path(config.socket).unlink(missing_ok=True)
            server.bind(str(config.socket))
            server.listen(16)
            threading.Thread(target=serve, daemon=True).start()
            with pytest.raises(SidecarUnavailable, match="did not answer"):
                SidecarClient(config.socket).call("GET", "/healthz")
            result = ckpt.restore(target)
    finally:
        server.close()
    assert result.step == 7 and torch.equal(target["w"], state["w"])
    assert any("read the tiers directly" in n for n in result.skipped), result.skipped


def test_c06_no_tier_holds_a_step_is_a_clear_error_never_a_silent_step_0(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    torch = pytest.importorskip("torch")
    from strata.client import Checkpointer, RestoreError

    config = config_for(shm_dir, tmp_path / "pvc")
    sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    with pytest.raises(StageError, match="no tier could serve rank 0 of step 7"):
        sidecar_api.stage(StageRequest(job_id=JOB, step=7, rank=0, world_size=1))
    with (
        Checkpointer(config, rank=0, world_size=1) as ckpt,
        pytest.raises(RestoreError, match="no restorable checkpoint"),
    ):
        ckpt.restore({"w": torch.zeros(3)})


# -- SIGTERM and SIGKILL ------------------------------------------------------------------------------


def test_c05_saves_racing_promotions_never_tear_a_promoted_copy(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """The trainer saves step after step (slots from the sidecar) while the sidecar promotes
    every one of them: each PVC copy equals the bytes saved as that step; nothing hangs."""
    pvc_root = tmp_path / "pvc"
    config = config_for(
        shm_dir, None, pvc={"path": str(pvc_root), "every": {"steps": 10}, "keep": 100}
    )
    sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    ram, pvc = RamTier(shm_dir, keep=1), PosixTier(pvc_root)
    size = 4 * 1024 * 1024
    saved, refused = [], 0
    for step in range(10, 310, 10):
        try:
            write_ram_shard(ram, JOB, step, 0, payload(step, n=size), provider=sidecar_api)
            saved.append(step)
        except SlotsBusy:
            refused += 1  # back-pressure: every slot still leased by promotion; never torn
    wait_until(lambda: saved[-1] in pvc.complete_steps(JOB), what="the last step promoted")
    promoted = pvc.complete_steps(JOB)
    assert promoted and set(promoted) <= set(saved)
    for step in promoted:
        assert committed_bytes(pvc, step) == payload(step, n=size)


def test_c14_sigterm_flushes_the_newest_ram_step_to_the_pvc_and_exits_0(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    pvc_root = tmp_path / "pvc"
    config = config_for(shm_dir, pvc_root)
    side = sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    ram, pvc = RamTier(shm_dir, keep=1), PosixTier(pvc_root)
    write_ram_shard(ram, JOB, 50, 0, payload(50), provider=sidecar_api)
    wait_until(lambda: pvc.complete_steps(JOB) == [50], what="step 50 promoted")
    # Step 70 is not due on the PVC (every 50) and its checksum pass has not run yet.
    write_ram_shard(ram, JOB, 70, 0, payload(70), provider=sidecar_api, verified=False)
    assert side.terminate() == 0
    assert pvc.complete_steps(JOB) == [50, 70]
    assert committed_bytes(pvc, 70) == payload(70)
    flush = [e for e in side.log_events() if e.get("event") == "flush"]
    assert flush and flush[-1]["ok"] is True and flush[-1]["step"] == 70


def test_c14_an_unreachable_bucket_never_delays_the_flush_to_the_pvc(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    pvc_root = tmp_path / "pvc"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = config_for(
        shm_dir, pvc_root, gcs={"bucket": "unreachable", "endpoint": dead, "every": {"steps": 10}}
    )
    side = sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    write_ram_shard(RamTier(shm_dir, keep=1), JOB, 70, 0, payload(70), provider=sidecar_api)
    assert side.terminate(timeout=40) == 0
    assert committed_bytes(PosixTier(pvc_root), 70) == payload(70)


def test_sigkill_during_promotion_never_loses_a_committed_durable_step(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    pvc_root = tmp_path / "pvc"
    config = config_for(
        shm_dir, None, pvc={"path": str(pvc_root), "every": {"steps": 10}, "keep": 2}
    )
    ram, pvc = RamTier(shm_dir, keep=1), PosixTier(pvc_root)
    big = 8 * 1024 * 1024
    rng = random.Random(7)
    committed: dict[int, bytes] = {}
    for i, step in enumerate(range(10, 70, 10)):
        data = payload(step, n=big)
        write_ram_shard(ram, JOB, step, 0, data, chunk_size=1024 * 1024)
        side = sidecar_proc(config)
        time.sleep(rng.uniform(0.0, 0.15) if i % 2 else 0.0)
        side.kill()  # SIGKILL at a random point of start-up / promotion
        # Invariant: every step committed on the PVC verifies, and what was committed stays
        # committed unless retention removed it for a newer complete step.
        complete = pvc.complete_steps(JOB)
        for s in complete:
            assert committed_bytes(pvc, s) == payload(s, n=big)
            committed[s] = b""
        newest = max(committed, default=None)
        if newest is not None:
            assert newest in complete, f"committed step {newest} lost after SIGKILL"
    # The next sidecar completes the promotion of the newest RAM step.
    side = sidecar_proc(config)
    wait_until(lambda: 60 in pvc.complete_steps(JOB), what="step 60 promoted after restart")
    assert committed_bytes(pvc, 60) == payload(60, n=big)
    assert side.terminate() == 0


# -- reports and metrics -------------------------------------------------------------------------------


def test_reports_reach_an_https_receiver_with_the_rotating_bearer_token_and_metrics_parse(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start, report_receiver: ReportReceiver
) -> None:
    token = tmp_path / "token"
    token.write_text("token-one\n")
    pvc_root = tmp_path / "pvc"
    config = config_for(
        shm_dir,
        pvc_root,
        policy="fast",
        namespace="ns",
        pod_name="train-0",
        report={
            "endpoint": report_receiver.url,
            "token_path": str(token),
            "ca_path": str(report_receiver.ca_path),
        },
    )
    side = sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    ram = RamTier(shm_dir, keep=1)
    write_ram_shard(ram, JOB, 50, 0, payload(50), provider=sidecar_api)
    sidecar_api.report(
        {"job_id": JOB, "rank": 0, "kind": "save", "step": 50, "ok": True, "stall_seconds": 0.004}
    )

    first = report_receiver.wait_for(
        lambda r: any(p["step"] == 50 for p in r["json"].get("promotions", []))
    )
    assert first["path"] == REPORT_PATH
    assert first["authorization"] == "Bearer token-one"
    report = SidecarReport.model_validate(first["json"])
    assert report.policy == "fast" and report.pod_name == "train-0" and report.job_id == JOB
    assert report.promotions[0].tier == "pvc" and report.promotions[0].bytes == len(payload(50))

    # The projected token rotates: the next report carries the new one.
    token.write_text("token-two\n")
    sidecar_api.report(
        {
            "job_id": JOB,
            "rank": 0,
            "kind": "restore",
            "step": 50,
            "tier": "ram",
            "outcome": "restored",
            "seconds": 0.1,
            "nbytes": 10,
        }
    )
    second = report_receiver.wait_for(lambda r: bool(r["json"].get("restores")))
    assert second["authorization"] == "Bearer token-two"
    assert SidecarReport.model_validate(second["json"]).tiers["pvc"].newest_complete_step == 50

    text = side.scrape()
    samples = metric_samples(text)
    assert samples[("strata_promotion_bytes_total", (("tier", "pvc"),))] == len(payload(50))
    assert samples[("strata_last_committed_step", (("tier", "pvc"),))] == 50
    assert samples[("strata_promotion_duration_seconds_count", (("tier", "pvc"),))] == 1
    assert samples[("strata_save_stall_seconds_count", ())] == 1
    assert samples[("strata_save_stall_seconds_sum", ())] == pytest.approx(0.004)
    print(
        "\n".join(
            line
            for line in text.splitlines()
            if line.startswith("strata_") and "_created" not in line and "_bucket" not in line
        )
    )


def test_report_delivery_retries_then_drops_without_blocking_promotion(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start, report_receiver: ReportReceiver
) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    report_receiver.status = 503
    pvc_root = tmp_path / "pvc"
    config = config_for(
        shm_dir,
        pvc_root,
        policy="p",
        namespace="ns",
        pod_name="train-0",
        report={
            "endpoint": report_receiver.url,
            "token_path": str(token),
            "ca_path": str(report_receiver.ca_path),
            "max_attempts": 2,
        },
    )
    side = sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    write_ram_shard(RamTier(shm_dir, keep=1), JOB, 50, 0, payload(50), provider=sidecar_api)
    wait_until(
        lambda: PosixTier(pvc_root).complete_steps(JOB) == [50],
        what="promotion despite a failing receiver",
    )
    wait_until(
        lambda: metric_samples(side.scrape()).get(("strata_reports_dropped_total", ()), 0) >= 1,
        what="a dropped report",
    )
    assert len(report_receiver.requests) >= 2  # retried before dropping


# -- slots API --------------------------------------------------------------------------------------------


def test_slots_are_allocated_by_the_sidecar_within_the_ram_size_limit(
    shm_dir: Path, sidecar_proc: Start
) -> None:
    limit = 8 * 1024 * 1024
    config = config_for(shm_dir, ram={"path": str(shm_dir), "keep": 1, "size_limit_bytes": limit})
    sidecar_proc(config)
    sidecar_api = connect(config.socket)
    assert sidecar_api is not None
    slot = sidecar_api.acquire_slot(JOB, 0, 3 * 1024 * 1024)
    assert slot.parent == shm_dir / JOB / "slots" / "rank-00000"
    assert os.stat(slot).st_blocks * 512 >= 3 * 1024 * 1024  # pre-allocated (pages charged)
    with pytest.raises(TierFull, match=r"ram\.size_limit_bytes=8388608"):
        sidecar_api.acquire_slot(JOB, 1, 3 * 1024 * 1024)
    with pytest.raises(TierError, match=r"serves job 'ns\.train', not 'ns\.other'"):
        sidecar_api.acquire_slot("ns.other", 0, 10)


# -- janitor ------------------------------------------------------------------------------------------------


def test_janitor_removes_only_stale_strata_job_directories(shm_dir: Path) -> None:
    ram = RamTier(shm_dir, keep=1)
    write_ram_shard(ram, "ns.live", 10, 0, payload(10))
    write_ram_shard(ram, "ns.gone", 10, 0, payload(10))
    for job in ("ns.live", "ns.gone"):
        (shm_dir / job / HEARTBEAT_NAME).touch()
    old = time.time() - 7200
    os.utime(shm_dir / "ns.gone" / HEARTBEAT_NAME, (old, old))
    (shm_dir / "not-strata").mkdir()
    (shm_dir / "not-strata" / "precious.txt").write_text("keep me")
    os.utime(shm_dir / "not-strata", (old, old))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.cli",
            "janitor",
            "--root",
            str(shm_dir),
            "--grace-seconds",
            "3600",
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (shm_dir / "ns.gone").exists()
    assert sorted(ram.list_steps("ns.live")) == [10]
    assert (shm_dir / "not-strata" / "precious.txt").read_text() == "keep me"
