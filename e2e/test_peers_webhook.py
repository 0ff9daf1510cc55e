"""Peer tier wiring through the real kube-apiserver (issue 16): a pod of a JobSet under a policy
with ``spec.peers`` is injected with the peer list, port and TLS mount, and the job's Secret is
created by the operator, owned by the policy. A burst of pods of one job asks the apiserver for
the workload and the Secret about once (counted by the apiserver itself), and a Secret deleted by a
user, or an operator restart, still ends with every pod's Secret in place."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import math
import time
from typing import Any

import pytest
from cryptography import x509
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families
from tests.fixtures.pods import PodBuilder, jobset_obj, policy_obj

from e2e.cluster import LocalCluster
from e2e.operator_fixtures import OperatorProcess
from strata.config import StrataConfig
from strata_operator.admission.peer_admission import (
    JOBSET_UID_LABEL,
    SECRET_TTL_SECONDS,
    WORKLOAD_TTL_SECONDS,
)
from strata_operator.admission.peers import PEER_TLS_MOUNT, job_uri, peer_secret_name
from strata_operator.constants import PEERS_TLS_VOLUME, SIDECAR_NAME

pytestmark = pytest.mark.e2e


def _pod(
    api_client: client.ApiClient,
    namespace: str,
    name: str,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    builder = (
        PodBuilder(name, namespace)
        .policy("fast")
        .label("jobset.sigs.k8s.io/jobset-name", "llm")
        .label("batch.kubernetes.io/job-name", "llm-workers-0")
        .container("train")
    )
    for key, value in (labels or {}).items():
        builder = builder.label(key, value)
    pod = builder.obj()
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
    assert [p.address for p in peers.members] == [
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


def _peer_config(pod: dict[str, Any]) -> tuple[list[str], str]:
    """The peer addresses in the pod's sidecar configuration and the Secret its TLS volume mounts."""
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    value = next(e["value"] for e in sidecar["env"] if e["name"] == "STRATA_CONFIG")
    peers = StrataConfig.from_env({"STRATA_CONFIG": value}).peers
    assert peers is not None
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == PEERS_TLS_VOLUME)
    return [p.address for p in peers.members], volume["secret"]["secretName"]


def _apiserver_requests(cluster: LocalCluster, verb: str, resource: str) -> dict[str, float]:
    """``apiserver_request_total`` of ``verb`` on ``resource`` by response code, as the apiserver
    counts them (every client; the tests of this module run alone)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(cluster.request("/metrics")):
        if family.name != "apiserver_request":
            continue
        for s in family.samples:
            if (
                s.name == "apiserver_request_total"
                and s.labels.get("verb") == verb
                and s.labels.get("resource") == resource
                and s.labels.get("dry_run", "") == ""
            ):
                out[s.labels["code"]] = out.get(s.labels["code"], 0.0) + s.value
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {c: int(after[c] - before.get(c, 0.0)) for c in after if after[c] > before.get(c, 0.0)}


BURST = 48


def test_a_burst_of_one_jobsets_pods_reads_the_jobset_and_creates_the_secret_about_once(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    """48 pods of the JobSet created at once, 16 at a time: every pod is injected with the
    JobSet's peer list and the job's Secret, and the apiserver saw at most one JobSet GET and one
    Secret create per TTL the burst lasted (before: one of each per pod, all Secret creates but
    the first a 409, and a key generated for each)."""
    _peers_policy_and_jobset(api, k8s_namespace)
    gets_before = _apiserver_requests(k8s_cluster, "GET", "jobsets")
    posts_before = _apiserver_requests(k8s_cluster, "POST", "secrets")
    begin = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        pods = list(
            pool.map(lambda i: _pod(api, k8s_namespace, f"llm-workers-0-{i}-burst"), range(BURST))
        )
    elapsed = time.monotonic() - begin
    gets = _delta(_apiserver_requests(k8s_cluster, "GET", "jobsets"), gets_before)
    posts = _delta(_apiserver_requests(k8s_cluster, "POST", "secrets"), posts_before)

    expected = [
        f"llm-workers-{j}-{p}.llm.{k8s_namespace}.svc:8477" for j in range(2) for p in range(2)
    ]
    name = peer_secret_name(f"{k8s_namespace}.llm")
    assert [_peer_config(pod) for pod in pods] == [(expected, name)] * BURST
    assert client.CoreV1Api(api).read_namespaced_secret(name, k8s_namespace).type == (
        "kubernetes.io/tls"
    )
    # One request per key at a time, each answer kept for its TTL: a burst longer than the TTL
    # (a slow machine) may ask again once per TTL.
    most_gets = 1 + math.ceil(elapsed / WORKLOAD_TTL_SECONDS)
    most_posts = 1 + math.ceil(elapsed / SECRET_TTL_SECONDS)
    assert sum(gets.values()) <= most_gets, (gets, f"{BURST} pods in {elapsed:.1f} s")
    assert posts.get("201") == 1, posts
    assert sum(posts.values()) <= most_posts, (posts, f"{BURST} pods in {elapsed:.1f} s")


def test_a_peer_secret_deleted_by_a_user_is_created_again_by_a_later_admission(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    """The operator cannot read Secrets, so it believes "the Secret exists" for
    SECRET_TTL_SECONDS; the first pod admitted after that has a deleted Secret created again
    (with new key material) by the renewal it starts, which runs in the background: the test
    waits for the Secret, up to a deadline far above a request's time."""
    _peers_policy_and_jobset(api, k8s_namespace)
    core = client.CoreV1Api(api)
    _, name = _peer_config(_pod(api, k8s_namespace, "llm-workers-0-0-first"))
    old = core.read_namespaced_secret(name, k8s_namespace).data
    core.delete_namespaced_secret(name, k8s_namespace)
    time.sleep(SECRET_TTL_SECONDS + 0.5)
    _, again = _peer_config(_pod(api, k8s_namespace, "llm-workers-0-1-after-delete"))
    assert again == name
    deadline = time.monotonic() + 30
    names: list[str] = []
    while time.monotonic() < deadline:
        names = [s.metadata.name for s in core.list_namespaced_secret(k8s_namespace).items]
        if name in names:
            break
        time.sleep(0.2)
    assert name in names, f"the deleted Secret {name} was not created again"
    recreated = core.read_namespaced_secret(name, k8s_namespace)
    assert recreated.type == "kubernetes.io/tls"
    assert recreated.data != old


def test_after_an_operator_restart_the_peer_secret_is_kept_and_pods_are_injected(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    """A restart empties the caches: the next pod's create is a 409 and the Secret (which running
    peers trust) is not replaced."""
    _peers_policy_and_jobset(api, k8s_namespace)
    core = client.CoreV1Api(api)
    peers, name = _peer_config(_pod(api, k8s_namespace, "llm-workers-0-0-before"))
    before = core.read_namespaced_secret(name, k8s_namespace).data
    operator_running.restart()
    assert _peer_config(_pod(api, k8s_namespace, "llm-workers-0-1-after")) == (peers, name)
    assert core.read_namespaced_secret(name, k8s_namespace).data == before


def test_a_jobset_created_again_under_its_name_is_read_again(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    """A pod that names its JobSet's uid (the JobSet controller labels every pod with it) is
    admitted with that JobSet's peer list, even right after another JobSet of the same name was
    read for an earlier pod."""
    _peers_policy_and_jobset(api, k8s_namespace)
    custom = client.CustomObjectsApi(api)
    peers, _ = _peer_config(_pod(api, k8s_namespace, "llm-workers-0-0-old"))
    assert len(peers) == 4
    custom.delete_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", k8s_namespace, "jobsets", "llm"
    )
    created: dict[str, Any] = custom.create_namespaced_custom_object(
        "jobset.x-k8s.io",
        "v1alpha2",
        k8s_namespace,
        "jobsets",
        jobset_obj("llm", replicas=3, completions=2),
    )
    uid = created["metadata"]["uid"]
    pod = _pod(api, k8s_namespace, "llm-workers-0-0-new", {JOBSET_UID_LABEL: uid})
    peers, _ = _peer_config(pod)
    assert peers == [
        f"llm-workers-{j}-{p}.llm.{k8s_namespace}.svc:8477" for j in range(3) for p in range(2)
    ]
