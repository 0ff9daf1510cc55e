"""Files of the Helm chart that are generated or copied: they must be current.

The helm-based checks (lint, template, server-side dry run, install) live in e2e/test_helm.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import yaml

import strata

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "strata"


def gen_schema():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_schema", CHART / "hack" / "gen-schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_crd_copy_is_identical_to_the_generated_crd() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    copied = sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml"))
    assert generated and generated == copied
    for name in generated:
        assert (CHART / "files" / "crds" / name).read_bytes() == (
            ROOT / "crds" / name
        ).read_bytes(), f"charts/strata/files/crds/{name} differs from crds/{name}: run `make crds`"


def test_values_schema_is_current_and_closed() -> None:
    expected = gen_schema().generate()
    assert (CHART / "values.schema.json").read_text() == expected, (
        "charts/strata/values.schema.json is stale: run charts/strata/hack/gen-schema.py"
    )
    schema = json.loads(expected)

    def closed(node: dict, path: str) -> None:  # type: ignore[type-arg]
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            for key, sub in node["properties"].items():
                closed(sub, f"{path}.{key}")

    closed(schema, "values")


def test_every_value_is_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    docs = gen_schema().comments_by_path((CHART / "values.yaml").read_text())

    def leaves(node: object, path: str) -> list[str]:
        if isinstance(node, dict) and node and path not in gen_schema().FREE_FORM:
            return [p for k, v in node.items() for p in leaves(v, f"{path}.{k}".lstrip("."))]
        return [path]

    undocumented = [p for p in leaves(values, "") if not docs.get(p)]
    assert undocumented == []


def test_an_undocumented_value_is_refused_by_the_generator(tmp_path: Path) -> None:
    module = gen_schema()
    module.VALUES = tmp_path / "values.yaml"
    module.VALUES.write_text(
        (CHART / "values.yaml").read_text() + "surprise: 1\n# -- only half\nhalf: 2\n"
    )
    with pytest.raises(SystemExit, match=r"undocumented values.*surprise"):
        module.generate()


def test_chart_version_matches_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == strata.__version__


@pytest.mark.parametrize(
    "script",
    [
        "e2e/kind/create-cluster.sh",
        "e2e/kind/delete-cluster.sh",
        "charts/strata/hack/render-manifests.sh",
    ],
)
def test_packaging_scripts_parse(script: str) -> None:
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_kind_script_builds_the_images_the_chart_and_examples_use() -> None:
    script = (ROOT / "e2e" / "kind" / "create-cluster.sh").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for repository in (values["image"]["repository"], values["sidecar"]["image"]["repository"]):
        assert f'"{repository}:$version"' in script, repository
    for example in ("job.yaml", "jobset.yaml", "pytorchjob.yaml"):
        assert "ghcr.io/strata-dev/strata-train:0.1.0" in (ROOT / "examples" / example).read_text()
    assert 'train_image="ghcr.io/strata-dev/strata-train:$version"' in script
    for dockerfile in ("operator/Dockerfile", "sidecar/Dockerfile", "examples/Dockerfile"):
        assert f"docker build -f {dockerfile} " in script, dockerfile
