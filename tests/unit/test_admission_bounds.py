"""Pod admission stays bounded whatever the job: the peers travel as name patterns, are checked in
linear work once per workload, the pod is built on the event loop, and a job beyond the peer
budget is refused with a "Strata:" message; pods whose
policy cannot work for them (copies or shards larger than the job, a pod-level CPU limit, a
volume named like Strata's) are refused or fixed at admission, not by the apiserver later."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonpatch
import pytest

from strata.config import StrataConfig
from strata.peers.config import PeerEndpoint, PeerRange, PeersConfig
from strata_operator import certs
from strata_operator.admission import webhook
from strata_operator.admission.configuration import WebhookOptions
from strata_operator.admission.mutation import InjectionError, InjectionSettings, build_pod_patch
from strata_operator.admission.peers import MAX_PEERS
from strata_operator.api.validation import parse_quantity
from strata_operator.constants import PEERS_TLS_VOLUME
from tests.fixtures.pods import PodBuilder, job_obj, jobset_obj, policy_obj

pytestmark = pytest.mark.unit

SETTINGS = InjectionSettings(sidecar_image="strata:test")


class _CountingId(str):
    """A peer id that counts its equality comparisons."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        type(self).comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_the_duplicate_check_of_the_peer_list_is_linear() -> None:
    n = 2000
    peers = tuple(
        PeerEndpoint.model_construct(id=_CountingId(f"p-{i}"), address=f"p-{i}:1") for i in range(n)
    )
    _CountingId.comparisons = 0
    PeersConfig(peers=peers, self_id="p-7")
    # Before: ids.count() per id, n * (n - 1) comparisons (4 million here).
    assert _CountingId.comparisons <= 4 * n
    dup = (*peers, PeerEndpoint(id="p-3", address="x:1"))
    with pytest.raises(ValueError, match=r"more than once: \['p-3'\]"):
        PeersConfig(peers=dup)


def _peer_policy(**peers: Any) -> dict[str, Any]:
    policy = policy_obj(pvc=None)
    policy["spec"]["peers"] = peers
    return policy


def _job_pod(job: str = "train") -> dict[str, Any]:
    return (
        PodBuilder(f"{job}-0-abcde", "team-a")
        .policy("fast")
        .label("batch.kubernetes.io/job-name", job)
        .container("train")
        .obj()
    )


def _job(n: int, name: str = "train") -> dict[str, Any]:
    obj = job_obj(name, completions=n)
    obj["metadata"]["namespace"] = "team-a"
    return obj


def _refusal(pod: dict[str, Any], policy: dict[str, Any], workload: dict[str, Any]) -> str:
    with pytest.raises(InjectionError) as err:
        build_pod_patch(pod, policy, SETTINGS, workload=workload)
    return str(err.value)


def test_a_job_larger_than_the_peer_budget_is_refused_with_what_to_do() -> None:
    message = _refusal(_job_pod(), _peer_policy(), _job(20_000))
    assert "20000 pods" in message and str(MAX_PEERS) in message
    assert "remove spec.peers" in message
    jobset = jobset_obj("llm", replicas=MAX_PEERS, completions=2) | {}
    jobset["metadata"]["namespace"] = "team-a"
    pod = _job_pod()
    pod["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] = "llm"
    assert f"{2 * MAX_PEERS} pods" in _refusal(pod, _peer_policy(), jobset)
    # At the budget the pod is injected.
    assert build_pod_patch(_job_pod(), _peer_policy(), SETTINGS, workload=_job(MAX_PEERS))


@pytest.mark.parametrize(
    ("peers", "n", "fragment"),
    [
        ({"copies": 3}, 3, "peers.copies is 3 but the job has 3 pod(s)"),
        ({"copies": 1}, 1, "a single-pod job has no peers"),
        ({"mode": "erasure", "dataShards": 6, "parityShards": 2}, 4, "needs 6 pods"),
        ({"mode": "erasure", "dataShards": 4, "parityShards": 3}, 5, "needs 6 pods"),
    ],
)
def test_copies_or_shards_larger_than_the_job_are_refused(
    peers: dict[str, Any], n: int, fragment: str
) -> None:
    message = _refusal(_job_pod(), _peer_policy(**peers), _job(n))
    assert fragment in message, message
    assert "run more pods" in message


def test_copies_and_shards_that_fit_the_job_are_admitted() -> None:
    cases: list[tuple[dict[str, Any], int]] = [
        ({"copies": 2}, 3),
        ({"mode": "erasure", "dataShards": 4, "parityShards": 2}, 6),
        ({"mode": "erasure", "dataShards": 2, "parityShards": 1}, 4),
    ]
    for peers, n in cases:
        assert build_pod_patch(_job_pod(), _peer_policy(**peers), SETTINGS, workload=_job(n))


def test_a_user_volume_named_like_the_peer_tls_volume_is_refused() -> None:
    pod = (
        PodBuilder("train-0-abcde", "team-a")
        .policy("fast")
        .label("batch.kubernetes.io/job-name", "train")
        .container("train")
        .volume(PEERS_TLS_VOLUME, emptyDir={})
        .obj()
    )
    message = _refusal(pod, _peer_policy(), _job(4))
    assert repr(PEERS_TLS_VOLUME) in message and "rename it" in message


def test_a_pod_level_cpu_limit_is_raised_by_the_sidecars_request() -> None:
    # The apiserver defaults pod-level requests from limits before admission.
    obj = (
        PodBuilder("p", "team-a")
        .policy("fast")
        .container("train")
        .spec_field("resources", {"requests": {"cpu": "100m"}, "limits": {"cpu": "100m"}})
        .obj()
    )
    ops = json.loads(json.dumps(build_pod_patch(obj, policy_obj(), SETTINGS)))
    patched = jsonpatch.apply_patch(obj, ops)
    pod_level = patched["spec"]["resources"]
    # Before: requests 350m over a 100m limit, refused by the apiserver without a word of Strata.
    assert parse_quantity(pod_level["requests"]["cpu"]) == parse_quantity("350m")
    assert parse_quantity(pod_level["limits"]["cpu"]) >= parse_quantity(
        pod_level["requests"]["cpu"]
    )


# --- the event loop ---------------------------------------------------------------------------


class _Api:
    """The two reads pod admission makes (the policy, the Job), answered from dicts."""

    def __init__(self, policy: dict[str, Any], job: dict[str, Any]) -> None:
        self.policy, self.job = policy, job

    def get_namespaced_custom_object(self, *_: Any, **__: Any) -> dict[str, Any]:
        copied: dict[str, Any] = json.loads(json.dumps(self.policy))
        return copied

    def read_namespaced_job(self, *_: Any, **__: Any) -> Any:
        return SimpleNamespace(data=json.dumps(self.job).encode())


def _peer_state(tmp_path: Path, pods: int, *others: dict[str, Any]) -> webhook.WebhookState:
    """A webhook state whose policy ``fast`` (namespace team-a) has peers, over an Indexed Job
    ``train`` of ``pods`` pods; ``others``: more policies in its cache."""
    peer_policy = _peer_policy() | {"metadata": {"name": "fast", "namespace": "team-a"}}
    fake = _Api(peer_policy, _job(pods))
    state = webhook.WebhookState(
        options=WebhookOptions(),
        injection=SETTINGS,
        tls=certs.generate(tmp_path),
        custom_api=fake,
        batch_api=fake,
    )
    state.policies.sync([peer_policy, *others], None)
    return state


def _admit_pod(state: webhook.WebhookState, pod: dict[str, Any], build: Any) -> list[Any]:
    async def admit() -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = await webhook._admit(
            "Pod", pod, [], state, build, webhook._pod_policy, dryrun=True
        )
        return ops

    return asyncio.run(admit())


def _strata_config(ops: list[dict[str, Any]]) -> str:
    sidecar = next(o["value"] for o in ops if o["path"].startswith("/spec/initContainers"))
    if isinstance(sidecar, list):
        sidecar = sidecar[-1]
    return str(next(e["value"] for e in sidecar["env"] if e["name"] == "STRATA_CONFIG"))


@pytest.mark.parametrize("pods", [64, MAX_PEERS])
def test_a_peers_pods_work_and_configuration_do_not_grow_with_its_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pods: int
) -> None:
    """A pod of a 64- or a 4,096-pod job is built on the event loop, carries the same few
    hundred bytes of peers, and, once its workload's first pod was admitted, costs no walk of
    the job's host names. Before, every pod carried the whole list (~350 KB at 4,096 peers, a
    4,096-pod job's pods 1.4 GB in etcd) and a large job's build went to a thread, whose wait
    under a burst reached 330 ms."""
    state = _peer_state(tmp_path, pods)
    threads: list[threading.Thread] = []
    walked: list[int] = []
    hosts = PeerRange.hosts

    def counting_hosts(self: PeerRange) -> Any:
        for h in hosts(self):
            walked.append(1)
            yield h

    monkeypatch.setattr(PeerRange, "hosts", counting_hosts)

    def recording_build(*args: Any) -> list[dict[str, Any]]:
        threads.append(threading.current_thread())
        return webhook._build_pod(*args)

    first = _admit_pod(state, _job_pod(), recording_build)
    walked.clear()
    second = _admit_pod(state, _job_pod("train"), recording_build)
    assert first and second
    assert threads == [threading.main_thread()] * 2
    assert walked == []  # the second pod reused its workload's validated configuration
    config = StrataConfig.from_env({"STRATA_CONFIG": _strata_config(second)})
    assert config.peers is not None and len(config.peers.members) == pods
    assert len(_strata_config(second)) < 1500
