"""The examples a newcomer copies: they parse, the policies are valid CheckpointPolicies, and the
annotated workloads get labelled and injected by the webhook's own pure functions."""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from strata_operator import api
from strata_operator.admission.mutation import (
    InjectionSettings,
    build_pod_patch,
)
from strata_operator.admission.workloads import build_workload_patch, pod_template_paths
from strata_operator.constants import (
    INJECTED_ANNOTATION,
    POLICY_LABEL,
    SIDECAR_NAME,
)

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKLOADS = ("job.yaml", "jobset.yaml", "pytorchjob.yaml")
POLICIES = ("policy.yaml", "policy-gcs.yaml")


def load(name: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d is not None]
    assert docs, f"examples/{name} is empty"
    return docs


def by_kind(name: str, kind: str) -> dict[str, Any]:
    (obj,) = [d for d in load(name) if d["kind"] == kind]
    return obj


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_is_a_named_kubernetes_object(name: str) -> None:
    for doc in load(name):
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), (name, doc.keys())
        assert doc["metadata"].get("name"), name


@pytest.mark.parametrize("name", POLICIES)
def test_policies_validate_against_the_api_model(name: str) -> None:
    policy = by_kind(name, api.KIND)
    assert policy["apiVersion"] == api.API_VERSION
    spec = api.CheckpointPolicySpec.model_validate(policy["spec"])
    assert spec.tiers.ram.size_limit
    assert spec.tiers.pvc is not None
    assert (
        spec.tiers.pvc.claim_name
        == by_kind("pvc.yaml", "PersistentVolumeClaim")["metadata"]["name"]
    )


def test_the_gcs_policy_has_all_three_tiers() -> None:
    spec = api.CheckpointPolicySpec.model_validate(by_kind("policy-gcs.yaml", api.KIND)["spec"])
    assert spec.configured_tiers() == ["ram", "pvc", "gcs"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_labelled_and_their_pods_injected(name: str) -> None:
    policy = by_kind("policy.yaml", api.KIND)
    (workload,) = [d for d in load(name) if d["kind"] in ("Job", "JobSet", "PyTorchJob")]
    assert workload["metadata"]["annotations"][POLICY_LABEL] == policy["metadata"]["name"]

    labelled = jsonpatch.apply_patch(workload, build_workload_patch(workload))
    templates = pod_template_paths(labelled)
    assert templates, name
    for _, template in templates:
        assert template["metadata"]["labels"][POLICY_LABEL] == policy["metadata"]["name"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**copy.deepcopy(template["metadata"]), "name": "p", "namespace": "ml"},
            "spec": copy.deepcopy(template["spec"]),
        }
        injected = jsonpatch.apply_patch(
            pod, build_pod_patch(pod, policy, InjectionSettings(), namespace="ml")
        )
        sidecars = [c for c in injected["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
        assert len(sidecars) == 1 and sidecars[0]["restartPolicy"] == "Always"
        assert (
            injected["metadata"]["annotations"][INJECTED_ANNOTATION] == policy["metadata"]["name"]
        )
        trainer = injected["spec"]["containers"][0]
        assert any(e["name"] == "STRATA_CONFIG" for e in trainer["env"]), trainer["env"]
        # The policy's grace period reaches the pod, so the SIGTERM flush fits in it (C-14).
        grace = policy["spec"]["sidecar"]["terminationGracePeriodSeconds"]
        assert injected["spec"]["terminationGracePeriodSeconds"] >= grace


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_run_the_example_training_image(name: str) -> None:
    (workload,) = [d for d in load(name) if d["kind"] in ("Job", "JobSet", "PyTorchJob")]
    for _, template in pod_template_paths(workload):
        images = {c["image"] for c in template["spec"]["containers"]}
        assert images == {"ghcr.io/strata-dev/strata-train:0.1.0"}, images


def test_train_py_uses_the_checkpointer_restore_should_save_save() -> None:
    source = (EXAMPLES / "train.py").read_text()
    tree = ast.parse(source)
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert {"Checkpointer", "restore", "should_save", "save"} <= called, called
