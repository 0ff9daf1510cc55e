"""A bounded run of the fault-injection campaign (issue 11; the long one is ``make chaos``):
real trainer and sidecar processes killed at chosen points, bit flips in committed data and
manifests on RAM, the PVC and GCS; every restore checked bit for bit. Seeded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.campaign import (
    MAX_SLOW_STARTS_IN_A_ROW,
    corruption_campaign,
    crash_campaign,
    write_counts,
)
from tests.fixtures.gcs import GcsEmulator

pytestmark = pytest.mark.integration


def test_corruptions_on_every_tier_never_restore_wrong_state(
    shm_dir: Path, gcs_emulator: GcsEmulator
) -> None:
    counts = corruption_campaign(
        shm_dir, corruptions=30, seed=11, gcs_endpoint=gcs_emulator.endpoint
    )
    assert counts.get("wrong_restores", 0) == 0, counts
    assert counts["corruptions"] >= 30 and counts["restores_checked"] >= 10
    # Every kind of damage was drawn: flips, truncations, deletions (seeded).
    kinds = {k.rsplit("_", 1)[-1] for k in counts if k.startswith("corrupt_")}
    assert {"flip", "truncate", "delete"} <= kinds, counts


def test_crashes_of_trainer_and_sidecar_never_lose_or_corrupt_a_committed_step(
    shm_dir: Path, gcs_emulator: GcsEmulator
) -> None:
    seen: list[dict[str, Any]] = []
    counts = crash_campaign(
        shm_dir, crash_points=8, seed=7, gcs_endpoint=gcs_emulator.endpoint, progress=seen.append
    )
    assert counts.get("wrong_restores", 0) == 0, counts
    assert counts["crash_points"] >= 8 and counts.get("restores_checked", 0) >= 2, counts
    assert "aborted" not in counts, counts
    assert counts["gcs_objects"] > 0, counts  # the killed sidecar was promoting to GCS too
    assert counts["sidecar_restarts_under_live_trainer"] >= 1, counts
    # The counts are handed out after every cycle, so a killed campaign keeps them.
    assert len(seen) == counts["cycles"] and seen[-1]["cycles"] == counts["cycles"]


def test_a_sidecar_that_is_never_ready_is_counted_and_ends_the_campaign_with_its_counts(
    shm_dir: Path,
) -> None:
    counts = crash_campaign(shm_dir, crash_points=8, seed=7, ready_seconds=0.0)
    assert counts["sidecar_slow_starts"] == MAX_SLOW_STARTS_IN_A_ROW, counts
    assert "not ready" in counts["aborted"], counts


def test_counts_are_written_atomically_and_replaced(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    write_counts(out, {"crash": {"cycles": 1}})
    write_counts(out, {"crash": {"cycles": 2}})
    assert json.loads(out.read_text()) == {"crash": {"cycles": 2}}
    assert list(tmp_path.iterdir()) == [out]
