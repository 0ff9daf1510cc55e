"""The sidecar image runs `strata sidecar`, installs the gcs and peers extras and never torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DOCKERFILE = Path(__file__).resolve().parents[2] / "sidecar" / "Dockerfile"


def test_sidecar_image_runs_strata_sidecar_with_gcs_and_without_torch() -> None:
    text = DOCKERFILE.read_text()
    entrypoints = re.findall(r"^ENTRYPOINT (.+)$", text, re.MULTILINE)
    assert json.loads(entrypoints[-1]) == ["strata", "sidecar"]
    installs = re.findall(r"pip install [^\n]*", text)
    assert installs and all(re.findall(r"\.\[([a-z,]+)\]", i) == ["gcs,peers"] for i in installs)
    assert '! /opt/strata/bin/python -c "import torch"' in text
    assert re.search(r"^USER 65532", text, re.MULTILINE)


def test_the_sidecar_and_its_client_side_import_without_torch() -> None:
    """The image has no torch: the sidecar, the CLI and the SidecarClient must not need it."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import strata.sidecar.service, strata.client.sidecar_client, strata.cli, strata.sidecar.promotion\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
