"""When the webhook may reuse a pod's workload read for an earlier pod
(strata_operator.admission.peer_admission.answers_pod): same uid, and the pod is one of its pods."""

from __future__ import annotations

from typing import Any

from strata_operator.admission.peer_admission import (
    JOBSET_UID_LABEL,
    answers_pod,
    cached_workload,
)
from tests.fixtures.pods import PodBuilder, job_obj, jobset_obj


def _with_uid(obj: dict[str, Any], uid: str) -> dict[str, Any]:
    obj["metadata"]["uid"] = uid
    obj["metadata"]["namespace"] = "team-a"
    return obj


def jobset_pod(uid: str | None = None, hostname: str | None = None) -> dict[str, Any]:
    b = PodBuilder("llm-workers-0-0-x", "team-a").label("jobset.sigs.k8s.io/jobset-name", "llm")
    if uid:
        b = b.label(JOBSET_UID_LABEL, uid)
    if hostname:
        b = b.spec_field("hostname", hostname)
    return b.container("train").obj()


def test_a_jobset_is_reused_for_its_own_pods_only() -> None:
    cached = cached_workload(_with_uid(jobset_obj("llm", replicas=2, completions=2), "u1"))
    assert cached.uid == "u1"
    assert cached.hosts == frozenset(f"llm-workers-{j}-{p}" for j in range(2) for p in range(2))
    assert answers_pod(cached, jobset_pod())
    assert answers_pod(cached, jobset_pod("u1", "llm-workers-1-1"))
    # A JobSet deleted and created again under the name: its pods carry the new uid.
    assert not answers_pod(cached, jobset_pod("u2", "llm-workers-1-1"))
    # A host name the cached JobSet does not have.
    assert not answers_pod(cached, jobset_pod("u1", "llm-workers-2-0"))


def test_an_indexed_job_that_grew_is_read_again_for_its_new_pods() -> None:
    cached = cached_workload(_with_uid(job_obj("train", completions=2), "j1"))
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": "train",
        "uid": "j1",
        "controller": True,
    }

    def pod(index: int, uid: str = "j1") -> dict[str, Any]:
        p = (
            PodBuilder(f"train-{index}-x", "team-a")
            .label("batch.kubernetes.io/job-name", "train")
            .spec_field("hostname", f"train-{index}")
            .container("train")
            .obj()
        )
        p["metadata"]["ownerReferences"] = [{**owner, "uid": uid}]
        return p

    assert answers_pod(cached, pod(1))
    assert not answers_pod(cached, pod(2))
    assert not answers_pod(cached, pod(0, uid="j2"))


def test_a_workload_without_peers_is_kept_without_host_names() -> None:
    cached = cached_workload(_with_uid(job_obj("plain", indexed=False), "j1"))
    assert cached.hosts is None
    pod = (
        PodBuilder("plain-x", "team-a")
        .label("batch.kubernetes.io/job-name", "plain")
        .spec_field("hostname", "whatever")
        .container("train")
        .obj()
    )
    assert answers_pod(cached, pod)
