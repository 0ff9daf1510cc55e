"""The RAM tier's directory must be a RAM disk: the default /strata/ram on a disk is refused
outside Kubernetes (client and sidecar), any other disk directory gets a loud warning, and
STRATA_ALLOW_DISK_RAM_DIR=1 accepts the default. Real mounts: /dev/shm, the test's tmp_path (a
disk here), a freshly mounted tmpfs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from strata.client import Checkpointer
from strata.config import DEFAULT_RAM_DIR
from strata.constants import ENV_ALLOW_DISK_RAM_DIR
from strata.errors import ConfigError
from strata.tiers.medium import check_ram_medium, medium_of

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _on_disk(path: Path) -> Path:
    m = medium_of(path)
    if m is None or m.in_ram:
        pytest.skip(f"{path} is not on a disk filesystem here ({m})")
    return path


def _default_on_disk() -> None:
    _on_disk(Path(DEFAULT_RAM_DIR))
    if os.path.exists(DEFAULT_RAM_DIR):
        pytest.skip(f"{DEFAULT_RAM_DIR} exists on this machine; the test must not touch it")


def _outside_k8s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv(ENV_ALLOW_DISK_RAM_DIR, raising=False)
    for var in ("STRATA_CONFIG", "STRATA_RAM_DIR", "STRATA_PVC_DIR", "STRATA_GCS_BUCKET"):
        monkeypatch.delenv(var, raising=False)


def test_medium_is_the_innermost_mount(
    shm_dir: Path, tmp_path: Path, small_tmpfs: Callable[[int], Path]
) -> None:
    shm = medium_of(shm_dir / "not" / "yet")  # nearest existing parent
    assert shm is not None and shm.in_ram and shm.fs_type == "tmpfs"
    disk = medium_of(_on_disk(tmp_path) / "ram")
    assert disk is not None and not disk.in_ram
    mounted = small_tmpfs(1 << 20)  # a tmpfs mounted inside the disk directory tree
    inner = medium_of(mounted / "ram")
    assert inner is not None and inner.in_ram and inner.mount_point == str(mounted)


def test_client_refuses_the_default_ram_dir_on_a_disk_outside_kubernetes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _default_on_disk()
    _outside_k8s(monkeypatch)
    with pytest.raises(ConfigError) as err:
        Checkpointer(job_id="ns.medium", rank=0, world_size=1, allow_fresh_start=True)
    msg = str(err.value)
    assert msg.startswith(f"Strata: the RAM tier directory {DEFAULT_RAM_DIR} (Checkpointer)")
    assert "not on a RAM disk" in msg and "STRATA_RAM_DIR=/dev/shm/strata" in msg
    assert f"{ENV_ALLOW_DISK_RAM_DIR}=1" in msg
    assert not os.path.exists(DEFAULT_RAM_DIR)  # nothing was written on the root disk


def test_sidecar_refuses_the_default_ram_dir_on_a_disk_with_exit_2(tmp_path: Path) -> None:
    _default_on_disk()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.update(
        STRATA_JOB_ID="ns.medium",
        STRATA_PVC_DIR=str(tmp_path / "pvc"),
        STRATA_CONFIG='{"metrics_port": 0}',
        PYTHONPATH=os.pathsep.join([str(REPO / "sidecar"), str(REPO)]),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli", "sidecar"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        f"strata sidecar: Strata: the RAM tier directory {DEFAULT_RAM_DIR} (strata sidecar)"
        in proc.stderr
    )
    assert not os.path.exists(DEFAULT_RAM_DIR)


def test_opt_out_and_pods_warn_instead(caplog: pytest.LogCaptureFixture) -> None:
    _default_on_disk()
    caplog.set_level(logging.WARNING, logger="strata.tiers.medium")
    for who, env in (
        ("opt-out", {ENV_ALLOW_DISK_RAM_DIR: "1"}),
        ("pod", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}),
    ):
        medium = check_ram_medium(DEFAULT_RAM_DIR, who=who, env=env)
        assert medium is not None and not medium.in_ram
        assert any(f"({who}) is on a" in r.getMessage() for r in caplog.records), who
    assert not os.path.exists(DEFAULT_RAM_DIR)


def test_an_explicit_disk_dir_works_with_a_warning_and_a_tmpfs_is_silent(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    shm_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    _outside_k8s(monkeypatch)
    caplog.set_level(logging.WARNING, logger="strata.tiers.medium")
    disk = _on_disk(tmp_path) / "ram"
    with Checkpointer(job_id="ns.medium", ram_dir=disk, rank=0, world_size=1) as c:
        assert c.save(0, {"w": torch.ones(4)})
    warned = [r.getMessage() for r in caplog.records]
    assert any(f"RAM tier directory {disk} (Checkpointer) is on a" in m for m in warned), warned
    caplog.clear()
    with Checkpointer(job_id="ns.medium", ram_dir=shm_dir / "ram", rank=0, world_size=1) as c:
        assert c.save(0, {"w": torch.ones(4)})
    assert not [r for r in caplog.records if "not on a RAM disk" in r.getMessage()]
