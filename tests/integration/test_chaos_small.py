"""A bounded run of the fault-injection campaign (issue 11; the long one is ``make chaos``):
real trainer and sidecar processes killed at chosen points, bit flips in committed data and
manifests on RAM, the PVC and GCS; every restore checked bit for bit. Seeded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.campaign import corruption_campaign, crash_campaign
from tests.fixtures.gcs import GcsEmulator

pytestmark = pytest.mark.integration


def test_corruptions_on_every_tier_never_restore_wrong_state(
    shm_dir: Path, gcs_emulator: GcsEmulator
) -> None:
    counts = corruption_campaign(
        shm_dir, corruptions=12, seed=11, gcs_endpoint=gcs_emulator.endpoint
    )
    assert counts.get("wrong_restores", 0) == 0, counts
    assert counts["corruptions"] >= 12 and counts["restores_checked"] >= 4


def test_crashes_of_trainer_and_sidecar_never_lose_or_corrupt_a_committed_step(
    shm_dir: Path,
) -> None:
    counts = crash_campaign(shm_dir, crash_points=8, seed=7)
    assert counts.get("wrong_restores", 0) == 0, counts
    assert counts["crash_points"] >= 8 and counts.get("restores_checked", 0) >= 2, counts
