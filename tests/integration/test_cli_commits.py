"""``strata list`` and ``strata verify`` read the global commit records (``commit.json``,
issue 12) of the PVC and GCS tiers: written by the tiers' own records code over real shards,
then corrupted for real. Skipped where this tree has no commit records yet."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from strata.cli import main
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from tests.fixtures.checkpoints import write_step
from tests.fixtures.gcs import GcsEmulator

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("strata.tiers.records") is None,
        reason="global commit records (issue 12) are not in this tree yet",
    ),
]

JOB = "team-a.committed"


def test_list_shows_the_commit_record_and_verify_checks_it(
    tmp_path: Path,
    gcs_emulator: GcsEmulator,
    gcs_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    records = importlib.import_module("strata.tiers.records")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    pvc = PosixTier(tmp_path / "pvc", "pvc")
    (tmp_path / "pvc").mkdir()
    with GcsTier(gcs_emulator.tier_config(gcs_bucket, prefix="c"), writer_id="t") as gcs:
        write_step([pvc, gcs], JOB, 10, 2)
        write_step([pvc], JOB, 20, 2)
        for tier in (pvc, gcs):
            assert records.commit_if_complete(tier, JOB, 10, "t") is not None
        specs = [str(pvc.root), f"gs://{gcs_bucket}/c"]

        assert main(["list", *specs, "--job", JOB, "-o", "json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        got = {(r["tier"], r["step"]): r["commit_record"] for r in rows}
        assert got == {("pvc", 20): False, ("pvc", 10): True, ("gcs", 10): True}

        assert main(["verify", *specs, "--job", JOB, "-o", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        commits = [r for r in doc["copies"] if r.get("object") == "commit.json"]
        assert [(r["tier"], r["step"], r["status"]) for r in commits] == [
            ("pvc", 10, "ok"),
            ("gcs", 10, "ok"),
        ]

        # Bit rot in the PVC's record: its seal no longer verifies.
        path = pvc.root / JOB / "steps" / f"{10:012d}" / "commit.json"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
        assert main(["verify", *specs, "--job", JOB, "--step", "10", "-o", "json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        bad = [r for r in doc["copies"] if r["status"] != "ok"]
        assert [(r["tier"], r.get("object"), r["status"]) for r in bad] == [
            ("pvc", "commit.json", "corrupt")
        ]
        assert doc["summary"]["bad"] == 1


def test_plan_names_a_superseded_step_instead_of_calling_its_ranks_missing(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The PVC holds incarnation X's committed steps 10 and 30; the job restored 10 since
    (incarnation Y), so 30 is superseded. ``strata plan`` picks 10 and says why 30 is not
    restorable (the step rule of strata.tiers.eligible); it used to list 30 as committed and
    then report it with no rank missing."""
    from strata.format.incarnation import Incarnation
    from strata.tiers.ram import RamTier
    from strata.tiers.records import commit_if_complete, write_incarnation
    from tests.fixtures.sidecar import write_ram_shard

    x = Incarnation(job_id=JOB, id="20260101T000000000000Z-aaaaaaaa", world_size=1)
    y = Incarnation(
        job_id=JOB, id="20260102T000000000000Z-bbbbbbbb", parent=x.id, base_step=10, world_size=1
    )
    pvc = PosixTier(tmp_path / "pvc", "pvc")
    staging = RamTier(shm_dir, keep=1)
    for step in (10, 30):
        m = write_ram_shard(staging, JOB, step, 0, bytes([step]) * 5000)
        m = m.model_copy(update={"incarnation": x.id})
        pvc.put_shard(JOB, step, 0, staging.data_path(JOB, step, 0), m)
        assert commit_if_complete(pvc, JOB, step, "t", records=[x]) is not None
    write_incarnation(pvc, y)
    assert main(["plan", str(pvc.root), "--job", JOB, "--world-size", "1", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 10
    assert doc["newer_steps_skipped"] == []
    assert any("step 30" in n and "superseded" in n for n in doc["notes"]), doc["notes"]
