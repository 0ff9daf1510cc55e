"""Issue 11, failure 6: the sidecar's private memory while it uploads a shard to GCS is bounded
independently of the shard's size, within the 256 MiB the webhook budgets for the sidecar process
(besides the RAM tier's tmpfs pages; README "Sidecar memory").

A real child process uploads a 256 MiB shard from tmpfs to fake-gcs-server through ``GcsTier``
with the production transfer settings, after ``bound_heap()`` as the sidecar does at start; its
``RssAnon`` (/proc/<pid>/status: private anonymous memory, what the container's memory limit is
charged for besides tmpfs) is sampled every 10 ms. Before the fix the same upload peaked at
about 323 MiB (8 workers each holding a whole composite part).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.gcs_upload_memory import measure

from tests.fixtures.gcs import GcsEmulator

pytestmark = pytest.mark.integration

SIDECAR_PROCESS_BUDGET_MIB = 256


def test_failure6_gcs_upload_private_memory_stays_within_the_sidecar_budget(
    shm_dir: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    row = measure(gcs_emulator.endpoint, gcs_bucket, 0.25, 1, shm_dir)
    assert row["peak_rss_anon_mib"] < SIDECAR_PROCESS_BUDGET_MIB, row
