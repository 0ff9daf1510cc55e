"""The generated CRD: structural, with defaults, CEL rules, printer columns; crds/ is current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from strata_operator import api, crdgen
from strata_operator.api import validation

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crdgen.crd()


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        out += _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    text = yaml.safe_dump(crd)
    assert "$ref" not in text and "$defs" not in text and "title:" not in text
    for path, node in _walk(_schema(crd)):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, (
            path
        )
        assert "anyOf" not in node and "oneOf" not in node and "allOf" not in node, path
        assert node.get("additionalProperties") is not False, path
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for key in ("minimum", "maximum"):
            assert key not in node or isinstance(node[key], int | float), path
        assert not isinstance(node.get("exclusiveMinimum"), int | float) or isinstance(
            node.get("exclusiveMinimum"), bool
        ), path


def test_defaults_are_set_and_valid_against_the_models(crd: dict[str, Any]) -> None:
    props = dict(_walk(_schema(crd)))
    assert props[".spec.tiers.ram.medium"]["default"] == "Memory"
    assert props[".spec.tiers.ram.keep"]["default"] == 1
    assert props[".spec.tiers.pvc.every"]["default"] == {"steps": 100}
    assert props[".spec.tiers.gcs.every"]["default"] == {"steps": 1000}
    assert props[".spec.restore.verify"]["default"] is True
    assert props[".spec.restore.allowFreshStart"]["default"] is False
    assert "default" not in props[".spec.restore.order"]
    for path, node in props.items():
        default = node.get("default")
        assert default is None or default != [] or "properties" in node, path
    assert props[".spec"]["required"] == ["tiers"]
    assert props[".spec.tiers.ram"]["required"] == ["sizeLimit"]
    # status lists are the operator's: no defaults that would add empty lists to every object
    assert "default" not in props[".status.conditions"]
    assert "default" not in props[".status.jobs"]


def test_cross_field_rules_are_cel(crd: dict[str, Any]) -> None:
    props = dict(_walk(_schema(crd)))
    rules = {
        path: [r["rule"] for r in node.get("x-kubernetes-validations", [])]
        for path, node in props.items()
    }
    tier_rules = " ".join(rules[".spec.tiers"])
    assert "self.pvc.every.steps % self.ram.every.steps == 0" in tier_rules
    assert "self.gcs.every.steps >= self.pvc.every.steps" in tier_rules
    assert "duration(self.gcs.every.duration) >= duration(self.pvc.every.duration)" in tier_rules
    assert any("has(self.tiers.pvc)" in r for r in rules[".spec"])
    assert any("exists_one" in r for r in rules[".spec.restore.order"])
    assert len(rules[".spec.tiers.gcs.bucket"]) == len(validation.BUCKET_RULES)
    assert any("quantity(" in r for r in rules[".spec.tiers.ram.sizeLimit"])
    assert any("hostPath" in r for r in rules[".spec.tiers.ram"])
    for path, node in props.items():
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"], path  # every rule says what to fix
    for path in (".spec.tiers.ram.keep", ".spec.tiers.pvc.keep", ".spec.tiers.gcs.keep"):
        assert props[path]["minimum"] == 1


def test_cel_and_pydantic_rules_share_their_messages() -> None:
    for rule in (api.RULE_PVC_STEPS_MULTIPLE, api.RULE_ORDER_CONFIGURED, api.RULE_SECRET_REF):
        assert rule.message in yaml.safe_dump(crdgen.crd(), width=10_000)


def test_names_columns_and_subresources(crd: dict[str, Any]) -> None:
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["ckpol"] and names["categories"] == ["strata"]
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Reason", "RAM", "PVC", "GCS", "Age"]
    status_props = _schema(crd)["properties"]["status"]["properties"]
    assert status_props["conditions"]["x-kubernetes-list-type"] == "map"
    assert status_props["jobs"]["maxItems"] == api.MAX_JOBS


def test_render_is_deterministic() -> None:
    assert crdgen.render() == crdgen.render()


def test_checked_in_crd_is_what_make_crds_generates() -> None:
    assert crdgen.check(REPO / "crds") == [], "crds/ is stale: run `make crds`"


def test_check_cli_fails_with_a_diff_when_stale(tmp_path: Path) -> None:
    target = tmp_path / crdgen.FILE_NAME
    target.write_text(crdgen.render().replace("ckpol", "ckp"), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "strata_operator.crdgen", "--check", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "-    - ckp\n+    - ckpol" in proc.stderr
    assert "make crds" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "strata_operator.crdgen", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert crdgen.check(tmp_path) == []
