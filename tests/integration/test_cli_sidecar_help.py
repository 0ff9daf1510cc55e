"""``strata sidecar --help`` lists the whole configuration, generated from StrataConfig."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from strata import constants
from strata.config import StrataConfig

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out.extend(_paths(ann, f"{prefix}{name}."))
            else:
                stack.extend(typing.get_args(ann))
    return out


def test_sidecar_help_lists_every_variable_and_field_with_its_default() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "sidecar"), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-m", "strata.cli", "sidecar", "--help"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    ).stdout
    listed = {line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ")}
    missing = [p for p in _paths(StrataConfig) if p not in listed]
    assert not missing, missing
    for var in (constants.ENV_CONFIG, constants.ENV_JOB_ID, constants.ENV_RAM_DIR,
                constants.ENV_PVC_DIR, constants.ENV_SOCKET, constants.ENV_GCS_BUCKET):  # fmt: skip
        assert f"  {var}: " in out, var
    assert "  STRATA_PVC_DIR: sets pvc.path" in out
    assert "  STRATA_RAM_DIR: sets ram.path" in out
    # Defaults are the model's, nested ones from the parent's default instance.
    assert '  ram.path: string, default "/strata/ram"' in out
    assert "  ram.every.steps: int | null, default 1" in out
    assert "  pvc.every.steps: int | null, default 100" in out
    assert "  gcs.bucket: string, required" in out
    assert "  metrics_port: int, default 9464  -- Port of /metrics" in out
    assert "strata sidecar" in out and "issue" not in out
