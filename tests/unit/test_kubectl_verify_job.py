"""The Job `kubectl strata verify job` creates: pure, from the policy object."""

from __future__ import annotations

import pytest

from strata_operator.kubectl import PluginError
from strata_operator.kubectl.verify import placement_of, verify_job_manifest
from tests.fixtures.pods import policy_obj

pytestmark = pytest.mark.unit


def test_mounts_the_claim_read_only_with_its_subpath_and_reads_gcs_with_the_secret_key() -> None:
    policy = policy_obj("fast", "team-a", pvc="ckpt", sub_path="runs/llm", image="reg/strata:1")
    policy["spec"]["tiers"]["gcs"] = {
        "bucket": "my-ckpts",
        "prefix": "llm",
        "credentials": {"type": "SecretRef", "secretRef": {"name": "gcs-key", "key": "sa.json"}},
    }
    job = verify_job_manifest(
        policy, "team-a.llm", step=40, fmt="json", image=None, service_account="trainer"
    )
    assert job["metadata"]["namespace"] == "team-a"
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "reg/strata:1"
    assert c["command"] == [
        "strata", "verify", "pvc:/strata/pvc", "gs://my-ckpts/llm",
        "--job", "team-a.llm", "--no-progress", "-o", "json", "--step", "40",
    ]  # fmt: skip
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["strata-pvc"] == {
        "name": "strata-pvc", "mountPath": "/strata/pvc", "readOnly": True, "subPath": "runs/llm"
    }  # fmt: skip
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["strata-pvc"]["persistentVolumeClaim"] == {"claimName": "ckpt", "readOnly": True}
    assert vols["strata-gcs-key"]["secret"] == {"secretName": "gcs-key"}
    assert {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": f"{mounts['strata-gcs-key']['mountPath']}/sa.json"} in c["env"]  # fmt: skip
    assert pod["serviceAccountName"] == "trainer" and pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Never injected: the webhook matches pods labelled strata.dev/policy.
    assert "strata.dev/policy" not in job["spec"]["template"]["metadata"]["labels"]
    assert job["spec"]["backoffLimit"] == 0


def test_a_ram_only_policy_has_nothing_a_job_can_verify() -> None:
    with pytest.raises(PluginError, match="only the RAM tier"):
        verify_job_manifest(
            policy_obj(pvc=None), "team-a.x", step=None, fmt="table", image=None,
            service_account=None,
        )  # fmt: skip


def test_the_verify_pod_runs_where_the_job_runs_its_node_selector_and_tolerations() -> None:
    training_pod = {
        "nodeSelector": {"pool": "a100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
        "serviceAccountName": "trainer",
    }
    placement = placement_of(training_pod)
    assert placement == {
        "nodeSelector": {"pool": "a100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    job = verify_job_manifest(
        policy_obj(), "team-a.x", step=None, fmt="table", image=None, service_account=None,
        placement=placement,
    )  # fmt: skip
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "a100"}
    assert pod["tolerations"] == training_pod["tolerations"]
    assert "affinity" not in pod
    # Without a training pod (none found), the scheduler's defaults.
    bare = verify_job_manifest(
        policy_obj(), "team-a.x", step=None, fmt="table", image=None, service_account=None,
        placement=placement_of({}),
    )["spec"]["template"]["spec"]  # fmt: skip
    assert "nodeSelector" not in bare and "tolerations" not in bare
