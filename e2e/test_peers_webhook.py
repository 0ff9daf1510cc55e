"""Peer tier wiring through the real kube-apiserver (issue 16): a pod of a JobSet under a policy
with ``spec.peers`` is injected with the peer list, port and TLS mount, and the job's Secret is
created by the operator, owned by the policy."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from cryptography import x509
from kubernetes import client
from tests.fixtures.pods import PodBuilder, jobset_obj, policy_obj

from e2e.operator_fixtures import OperatorProcess
from strata.config import StrataConfig
from strata_operator.admission.peers import PEER_TLS_MOUNT, job_uri, peer_secret_name
from strata_operator.constants import PEERS_TLS_VOLUME, SIDECAR_NAME

pytestmark = pytest.mark.e2e


def _pod(api_client: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    pod = (
        PodBuilder(name, namespace)
        .policy("fast")
        .label("jobset.sigs.k8s.io/jobset-name", "llm")
        .label("batch.kubernetes.io/job-name", "llm-workers-0")
        .container("train")
        .obj()
    )
    created = client.CoreV1Api(api_client).create_namespaced_pod(
        namespace, pod, _preload_content=False
    )
    data: dict[str, Any] = json.loads(created.data)
    return data


def _peers_policy_and_jobset(api_client: client.ApiClient, namespace: str) -> dict[str, Any]:
    """Policy ``fast`` with ``spec.peers`` (one replica) and the JobSet ``llm`` (2 x 2) whose
    pods the tests create; returns the policy as created."""
    custom = client.CustomObjectsApi(api_client)
    policy = policy_obj(namespace=namespace, pvc=None)
    policy["spec"]["peers"] = {"mode": "replicate", "copies": 1}
    created: dict[str, Any] = custom.create_namespaced_custom_object(
        "strata.dev", "v1alpha1", namespace, "checkpointpolicies", policy
    )
    custom.create_namespaced_custom_object(
        "jobset.x-k8s.io",
        "v1alpha2",
        namespace,
        "jobsets",
        jobset_obj("llm", replicas=2, completions=2),
    )
    return created


def test_jobset_pod_gets_peer_config_and_the_job_secret_exists(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    created_policy = _peers_policy_and_jobset(api, k8s_namespace)
    pod = _pod(api, k8s_namespace, "llm-workers-0-0-aaaaa")
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    value = next(e["value"] for e in sidecar["env"] if e["name"] == "STRATA_CONFIG")
    peers = StrataConfig.from_env({"STRATA_CONFIG": value}).peers
    assert peers is not None and peers.copies == 1
    assert [p.address for p in peers.peers] == [
        f"llm-workers-{j}-{p}.llm.{k8s_namespace}.svc:8477" for j in range(2) for p in range(2)
    ]
    assert any(p.get("name") == "strata-peers" for p in sidecar["ports"])
    assert {"name": PEERS_TLS_VOLUME, "mountPath": PEER_TLS_MOUNT, "readOnly": True} in sidecar[
        "volumeMounts"
    ]
    train = pod["spec"]["containers"][0]
    assert all(m["name"] != PEERS_TLS_VOLUME for m in train.get("volumeMounts", []))

    job_id = f"{k8s_namespace}.llm"
    name = peer_secret_name(job_id)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == PEERS_TLS_VOLUME)
    assert volume["secret"]["secretName"] == name
    secret = client.CoreV1Api(api).read_namespaced_secret(name, k8s_namespace)
    assert secret.type == "kubernetes.io/tls"
    owner = secret.metadata.owner_references[0]
    assert (owner.kind, owner.uid) == ("CheckpointPolicy", created_policy["metadata"]["uid"])
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret.data["tls.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [job_uri(job_id)]

    # A second pod of the job: the Secret is reused (409 is success), not replaced.
    _pod(api, k8s_namespace, "llm-workers-0-1-bbbbb")
    again = client.CoreV1Api(api).read_namespaced_secret(name, k8s_namespace)
    assert again.data == secret.data


def test_dry_run_pod_is_injected_without_creating_the_peer_secret(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    """``kubectl create --dry-run=server`` of a peers pod: the webhook answers with the full
    patch (the apiserver calls it because the configuration says ``NoneOnDryRun``) but makes no
    Secret; the first real pod of the job makes it."""
    _peers_policy_and_jobset(api, k8s_namespace)
    core = client.CoreV1Api(api)
    pod = (
        PodBuilder("llm-workers-0-0-dryrun", k8s_namespace)
        .policy("fast")
        .label("jobset.sigs.k8s.io/jobset-name", "llm")
        .label("batch.kubernetes.io/job-name", "llm-workers-0")
        .container("train")
        .obj()
    )
    answered = core.create_namespaced_pod(k8s_namespace, pod, dry_run="All", _preload_content=False)
    dry: dict[str, Any] = json.loads(answered.data)
    volume = next(v for v in dry["spec"]["volumes"] if v["name"] == PEERS_TLS_VOLUME)
    name = peer_secret_name(f"{k8s_namespace}.llm")
    assert volume["secret"]["secretName"] == name
    names = [s.metadata.name for s in core.list_namespaced_secret(k8s_namespace).items]
    assert name not in names, "a dry run created the job's peer Secret"
    _pod(api, k8s_namespace, "llm-workers-0-0-real")
    assert core.read_namespaced_secret(name, k8s_namespace).type == "kubernetes.io/tls"
