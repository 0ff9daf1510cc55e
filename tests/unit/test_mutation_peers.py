"""Pod injection with the peer tier on (issue 16, docs/peers.md "Operator and webhook changes")."""

from __future__ import annotations

import json
from typing import Any

import jsonpatch
import pytest

from strata.config import StrataConfig
from strata_operator.admission.mutation import InjectionError, InjectionSettings, build_pod_patch
from strata_operator.admission.peer_admission import peer_secret_body
from strata_operator.admission.peers import PEER_TLS_MOUNT, peer_secret_name
from strata_operator.api import CheckpointPolicySpec
from strata_operator.constants import PEERS_TLS_VOLUME, SIDECAR_NAME
from tests.fixtures.pods import PodBuilder, job_obj, jobset_obj, policy_obj

pytestmark = pytest.mark.unit

SETTINGS = InjectionSettings(sidecar_image="strata:test")


def peer_policy(**peers: Any) -> dict[str, Any]:
    policy = policy_obj()
    policy["spec"]["peers"] = peers
    return policy


def jobset_pod() -> dict[str, Any]:
    return (
        PodBuilder("llm-workers-1-0-abcde", "team-a")
        .policy("fast")
        .label("jobset.sigs.k8s.io/jobset-name", "llm")
        .label("batch.kubernetes.io/job-name", "llm-workers-1")
        .container("train")
        .obj()
    )


def inject(pod: dict[str, Any], policy: dict[str, Any], **kw: Any) -> dict[str, Any]:
    ops = json.loads(json.dumps(build_pod_patch(pod, policy, SETTINGS, **kw)))
    return jsonpatch.apply_patch(pod, ops)  # type: ignore[no-any-return]


def config_of(container: dict[str, Any]) -> StrataConfig:
    value = next(e["value"] for e in container["env"] if e["name"] == "STRATA_CONFIG")
    return StrataConfig.from_env({"STRATA_CONFIG": value})


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)


def test_jobset_pod_gets_peer_config_port_failure_domain_and_sidecar_only_secret() -> None:
    workload = jobset_obj("llm", replicas=2, completions=2) | {"metadata": {"name": "llm"}}
    workload["metadata"]["namespace"] = "team-a"
    pod = inject(
        jobset_pod(), peer_policy(mode="erasure", dataShards=2, parityShards=1), workload=workload
    )
    sidecar, train = sidecar_of(pod), pod["spec"]["containers"][0]
    config = config_of(sidecar)
    assert config.peers is not None
    assert (config.peers.mode, config.peers.data_shards, config.peers.parity_shards) == (
        "erasure",
        2,
        1,
    )
    assert [p.id for p in config.peers.members] == [
        f"llm-workers-{j}-{p}" for j in range(2) for p in range(2)
    ]
    assert config.peers.members[3].address == "llm-workers-1-1.llm.team-a.svc:8477"
    assert config_of(train).peers == config.peers
    assert {"name": "strata-peers", "containerPort": 8477, "protocol": "TCP"} in sidecar["ports"]
    zone = next(e for e in sidecar["env"] if e["name"] == "STRATA_FAILURE_DOMAIN")
    assert zone["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['topology.kubernetes.io/zone']"
    )
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == PEERS_TLS_VOLUME)
    assert volume["secret"]["secretName"] == peer_secret_name("team-a.llm")
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == PEERS_TLS_VOLUME)
    assert (mount["mountPath"], mount["readOnly"]) == (PEER_TLS_MOUNT, True)
    # The key stays out of the training containers: mounts and env alike.
    assert all(m["name"] != PEERS_TLS_VOLUME for m in train.get("volumeMounts", []))
    assert "STRATA_FAILURE_DOMAIN" not in {e["name"] for e in train["env"]}
    assert "subdomain" not in pod["spec"]  # JobSet sets its own
    assert build_pod_patch(pod, peer_policy(), SETTINGS, workload=workload) == []


def test_indexed_job_pod_gets_the_peer_service_subdomain() -> None:
    workload = job_obj("pretrain") | {"kind": "Job"}
    workload["metadata"]["namespace"] = "team-a"
    workload["spec"] |= {"completionMode": "Indexed", "completions": 3}
    pod = inject(
        PodBuilder("pretrain-0-x", "team-a")
        .policy("fast")
        .label("batch.kubernetes.io/job-name", "pretrain")
        .container("train")
        .obj(),
        peer_policy(copies=2, port=9000),
        workload=workload,
    )
    assert pod["spec"]["subdomain"] == "strata-peers-pretrain"
    config = config_of(sidecar_of(pod))
    assert config.peers is not None and config.peers.copies == 2
    assert config.peers.members[0].address == "pretrain-0.strata-peers-pretrain.team-a.svc:9000"


def test_peers_off_changes_nothing_and_peers_on_without_workload_is_refused() -> None:
    pod = inject(jobset_pod(), policy_obj(), workload=jobset_obj("llm"))
    assert build_pod_patch(jobset_pod(), policy_obj(), SETTINGS, workload=jobset_obj("llm")) == (
        build_pod_patch(jobset_pod(), policy_obj(), SETTINGS)
    )
    sidecar = sidecar_of(pod)
    assert config_of(sidecar).peers is None
    assert PEERS_TLS_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
    assert [p["name"] for p in sidecar["ports"]] == ["strata-metrics"]
    assert "STRATA_FAILURE_DOMAIN" not in {e["name"] for e in sidecar["env"]}
    with pytest.raises(InjectionError, match="JobSet or an Indexed Job"):
        build_pod_patch(jobset_pod(), peer_policy(), SETTINGS)
    plain_job = job_obj("pretrain", indexed=False)
    with pytest.raises(InjectionError, match="completionMode: Indexed"):
        build_pod_patch(jobset_pod(), peer_policy(), SETTINGS, workload=plain_job)


def test_policy_peer_fields_are_validated() -> None:
    spec = {"tiers": {"ram": {"sizeLimit": "1Gi"}}}
    assert CheckpointPolicySpec.model_validate(spec | {"peers": {}}).peers is not None
    for bad in ({"mode": "mirror"}, {"copies": 0}, {"port": 80}, {"port": 9464}):
        with pytest.raises(ValueError):
            CheckpointPolicySpec.model_validate(spec | {"peers": bad})


def test_peer_secret_is_tls_and_owned_by_the_policy() -> None:
    policy = policy_obj()
    policy["metadata"]["uid"] = "u-1"
    body = peer_secret_body("team-a.llm", policy)
    assert body["type"] == "kubernetes.io/tls"
    assert set(body["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    owner = body["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("CheckpointPolicy", "fast", "u-1")
