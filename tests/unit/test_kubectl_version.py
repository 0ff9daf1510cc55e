"""``kubectl strata version --client``: the plugin's version without a cluster (the cluster part
is tested against a real apiserver in e2e/test_kubectl_strata.py)."""

from __future__ import annotations

import json

import pytest

import strata
from strata_operator.kubectl import main
from strata_operator.kubectl.version import _minor

pytestmark = pytest.mark.unit


def test_client_version_needs_no_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--client", "--kubeconfig", "/nonexistent", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["client"]["version"] == strata.__version__ and "operators" not in doc
    assert main(["version", "--client"]) == 0
    assert capsys.readouterr().out.startswith(f"kubectl-strata {strata.__version__} ")


def test_skew_compares_major_and_minor() -> None:
    assert _minor("0.1.0") == _minor("v0.1.7") != _minor("0.2.0")
