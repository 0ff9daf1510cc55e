"""Issue 11, failure 8: a PVC too small for keep + 1 steps is said, in metrics, in the sidecar's
log and in its report (for the policy status), instead of silently never advancing again."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from strata.client.sidecar_client import connect
from strata.reports import SidecarReport
from strata.tiers.ram import RamTier
from tests.fixtures.sidecar import ReportReceiver, SidecarProcess, write_ram_shard
from tests.integration.test_sidecar import JOB, config_for, metric_samples, wait_until

pytestmark = pytest.mark.integration
Start = Callable[..., SidecarProcess]
SHARD = 700 * 1024


def payload(step: int) -> bytes:
    return bytes((step * 31 + i) & 0xFF for i in range(256)) * (SHARD // 256)


def test_failure8_pvc_too_small_for_keep_plus_one_is_reported(
    shm_dir: Path,
    tmp_path: Path,
    small_tmpfs: Callable[[int], Path],
    sidecar_proc: Start,
    report_receiver: ReportReceiver,
) -> None:
    pvc_root = small_tmpfs(2 * 1024 * 1024)  # room for 2 steps of 700 KiB, not 3
    token = tmp_path / "token"
    token.write_text("t\n")
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
        pvc={"path": str(pvc_root), "every": {"steps": 10}, "keep": 2},
    )
    side = sidecar_proc(config)
    api = connect(config.socket)
    assert api is not None
    ram = RamTier(shm_dir, keep=1)
    for step in (10, 20, 30):
        write_ram_shard(ram, JOB, step, 0, payload(step), provider=api)
        if step < 30:
            wait_until(partial(contains, pvc_root, step), what=f"step {step} on the PVC")

    def gauge() -> float | None:
        return metric_samples(side.scrape()).get(("strata_tier_too_small", (("tier", "pvc"),)))

    wait_until(lambda: gauge() == 1, what="strata_tier_too_small{tier=pvc} == 1")
    events = [e for e in side.log_events() if e.get("event") == "tier_too_small"]
    assert events and "too small for keep + 1 = 3 steps" in events[0]["message"]
    report = report_receiver.wait_for(
        lambda r: bool(((r["json"].get("tiers") or {}).get("pvc") or {}).get("too_small"))
    )
    state = SidecarReport.model_validate(report["json"]).tiers["pvc"]
    assert state.too_small is not None and "lower pvc.keep" in state.too_small


def contains(root: Path, step: int) -> bool:
    from strata.tiers.posix import PosixTier

    return step in PosixTier(root).complete_steps(JOB)
