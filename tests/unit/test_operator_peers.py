"""Control-plane builders of the peer tier: peer lists follow the host names JobSet and Indexed
Jobs give (the per-job Secret is tested against the real TLS server in
tests/integration/test_peers.py)."""

from __future__ import annotations

import pytest

from strata.peers import transport
from strata.peers.config import PeerEndpoint, PeerRange, PeersConfig
from strata_operator.admission.peers import (
    PeerSpecError,
    job_uri,
    workload_peer_ranges,
    workload_peers,
)

pytestmark = pytest.mark.unit


def test_job_uri_matches_what_the_sidecar_checks() -> None:
    assert job_uri("ns.train") == transport.job_uri("ns.train")


def jobset(name: str, rjobs: list[tuple[str, int, int]], **network: object) -> dict[str, object]:
    return {
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {
            "network": network,
            "replicatedJobs": [
                {
                    "name": r,
                    "replicas": replicas,
                    "template": {"spec": {"completionMode": "Indexed", "completions": pods}},
                }
                for r, replicas, pods in rjobs
            ],
        },
    }


def test_jobset_peers_are_the_pod_host_names() -> None:
    peers = workload_peers(jobset("llm", [("workers", 2, 2), ("driver", 1, 1)]))
    assert [p["id"] for p in peers] == [
        "llm-workers-0-0",
        "llm-workers-0-1",
        "llm-workers-1-0",
        "llm-workers-1-1",
        "llm-driver-0-0",
    ]
    assert peers[0]["address"] == "llm-workers-0-0.llm.team.svc:8477"
    # The sidecar configuration accepts the list as is.
    PeersConfig(peers=tuple(PeerEndpoint(**p) for p in peers), self_id="llm-driver-0-0")
    # What a pod carries is the ranges; the sidecar expands them into the same list.
    workload = jobset("llm", [("workers", 2, 2), ("idle", 0, 3), ("driver", 1, 1)])
    ranges = workload_peer_ranges(workload)
    assert [r["prefix"] for r in ranges] == ["llm-workers-", "llm-driver-"]  # 0 replicas: none
    config = PeersConfig(ranges=tuple(PeerRange(**r) for r in ranges), self_id="llm-driver-0-0")
    assert [p.model_dump() for p in config.members] == [
        PeerEndpoint(**p).model_dump() for p in peers
    ]
    sub = workload_peers(jobset("llm", [("w", 1, 1)], subdomain="net"), port=9000)
    assert sub[0]["address"] == "llm-w-0-0.net.team.svc:9000"


def test_workloads_without_stable_host_names_are_refused_with_the_fix() -> None:
    with pytest.raises(PeerSpecError, match="enableDNSHostnames"):
        workload_peers(jobset("llm", [("w", 1, 1)], enableDNSHostnames=False))
    job = {"kind": "Job", "metadata": {"name": "t", "namespace": "n"}, "spec": {"parallelism": 2}}
    with pytest.raises(PeerSpecError, match="completionMode: Indexed"):
        workload_peers(job)
    job["spec"] = {"completionMode": "Indexed", "completions": 2}
    assert [p["address"] for p in workload_peers(job)] == [
        "t-0.strata-peers-t.n.svc:8477",
        "t-1.strata-peers-t.n.svc:8477",
    ]
    (indexed,) = workload_peer_ranges(job)
    assert [p.address for p in PeerRange(**indexed).endpoints()] == [
        "t-0.strata-peers-t.n.svc:8477",
        "t-1.strata-peers-t.n.svc:8477",
    ]
    with pytest.raises(PeerSpecError, match="PyTorchJob"):
        workload_peers({"kind": "PyTorchJob", "metadata": {"name": "p"}, "spec": {}})
