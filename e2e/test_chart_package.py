"""``make chart``: the Helm chart packaged as a user (or ``helm push oci://...``) gets it, with
the package's version as its version and appVersion; the packaged chart renders exactly what the
chart directory renders, and carries its CRD, schema and dashboard but not its build helpers."""

from __future__ import annotations

import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

from e2e.cluster import REPO_ROOT, Binaries

pytestmark = pytest.mark.e2e


def test_make_chart_packages_the_chart_with_the_package_version(
    k8s_binaries: Binaries, tmp_path: Path
) -> None:
    helm = k8s_binaries.bin_dir / "helm"
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = tmp_path / "dist"
    subprocess.run(
        ["make", "-s", "chart", f"CHART_DIR={out}", f"HELM={helm}"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (tgz,) = out.iterdir()
    assert tgz.name == f"strata-{version}.tgz"  # <name>-<version>.tgz: what helm push expects
    with tarfile.open(tgz) as tar:
        names = set(tar.getnames())
        chart_file = tar.extractfile("strata/Chart.yaml")
        assert chart_file is not None
        chart = yaml.safe_load(chart_file.read())
    assert chart["version"] == version and chart["appVersion"] == version
    for needed in (
        "strata/values.schema.json",
        "strata/files/crds/checkpointpolicies.strata.dev.yaml",
        "strata/dashboards/strata.json",
        "strata/templates/podmonitor.yaml",
    ):
        assert needed in names, needed
    assert not [n for n in names if n.startswith("strata/hack/")]

    def render(chart_ref: Path, *values: str) -> str:
        args = [str(helm), "template", "strata", str(chart_ref), "-n", "strata-system"]
        args += ["--kube-version", "1.35.4", *values]
        return subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout

    directory = REPO_ROOT / "charts" / "strata"
    assert render(tgz) == render(directory)
    monitoring = ["--set", "metrics.prometheusRule.enabled=true"]
    monitoring += ["--set", "metrics.grafanaDashboard.enabled=true"]
    assert render(tgz, *monitoring) == render(directory, *monitoring)
