"""The local control plane itself: version, fake nodes, the real Job controller and scheduler,
kwok's failure stages, service-account tokens, and a clean stop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from e2e.cluster import (
    FAKE_NODE_ANNOTATION,
    REPO_ROOT,
    Binaries,
    LocalCluster,
    pid_alive,
)

pytestmark = pytest.mark.e2e

T = TypeVar("T")


def eventually(probe: Callable[[], T | None], what: str, timeout: float = 90.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.25)


def make_indexed_job(
    name: str, node: str, completions: int, backoff_limit: int = 3
) -> dict[str, Any]:
    """An Indexed Job whose pods are pinned to ``node`` (a kwok node: the image never runs)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": backoff_limit,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{"name": "trainer", "image": "registry.invalid/trainer:1"}],
                }
            },
        },
    }


def job_pods(core: client.CoreV1Api, namespace: str, job: str) -> list[client.V1Pod]:
    pods: list[client.V1Pod] = core.list_namespaced_pod(
        namespace, label_selector=f"batch.kubernetes.io/job-name={job}"
    ).items
    return pods


def test_version_reports_the_built_release(k8s_cluster: LocalCluster, api: Any) -> None:
    info = client.VersionApi(api).get_code()
    assert info.git_version != "v0.0.0", "version ldflags were not applied"
    if not os.environ.get("KUBEBUILDER_ASSETS"):
        expected = os.environ.get("STRATA_K8S_VERSION", "v1.35.4")
        assert info.git_version == expected
        assert (info.major, info.minor) == ("1", expected.split(".")[1])
    assert k8s_cluster.server.startswith("https://127.0.0.1:")
    # kubectl reads the same kubeconfig.
    assert (
        json.loads(k8s_cluster.kubectl("version", "-o", "json"))["serverVersion"]["gitVersion"]
        == info.git_version
    )


def test_fake_node_becomes_ready_through_kwok(k8s_cluster: LocalCluster, api: Any) -> None:
    node = k8s_cluster.create_fake_node("kwok-ready-check", wait_ready=False)
    assert node["metadata"]["annotations"][FAKE_NODE_ANNOTATION] == "fake"

    def ready() -> bool:
        conditions = client.CoreV1Api(api).read_node("kwok-ready-check").status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    eventually(ready, "kwok to mark the node Ready")
    out = k8s_cluster.kubectl("get", "node", "kwok-ready-check", "-o", "json")
    assert json.loads(out)["status"]["nodeInfo"]["kubeletVersion"], "kwok fills nodeInfo"
    client.CoreV1Api(api).delete_node("kwok-ready-check")


def test_indexed_job_pods_are_created_scheduled_and_run(
    k8s_cluster: LocalCluster, k8s_namespace: str, k8s_fake_node: str, api: Any
) -> None:
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.create_namespaced_job(k8s_namespace, make_indexed_job("train", k8s_fake_node, 2))

    def running() -> list[client.V1Pod] | None:
        pods = job_pods(core, k8s_namespace, "train")
        ok = len(pods) == 2 and all(p.status.phase == "Running" for p in pods)
        return pods if ok else None

    pods = eventually(running, "2 Running pods of the indexed Job")
    assert {p.spec.node_name for p in pods} == {k8s_fake_node}
    indexes = {p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods}
    assert indexes == {"0", "1"}
    # The ServiceAccount admission plugin mounted the projected API token (default SA exists).
    assert all(any(v.projected is not None for v in p.spec.volumes or []) for p in pods), (
        "projected service-account token volume missing"
    )

    # Pods stay Running until asked to complete; completing both completes the Job.
    for p in pods:
        k8s_cluster.complete_pod(k8s_namespace, p.metadata.name)

    def complete() -> bool:
        conditions = batch.read_namespaced_job_status("train", k8s_namespace).status.conditions
        return any(c.type == "Complete" and c.status == "True" for c in conditions or [])

    eventually(complete, "the Job to be Complete")
    assert batch.read_namespaced_job_status("train", k8s_namespace).status.succeeded == 2


def test_pod_failed_by_kwok_chaos_stage_is_replaced_by_job_controller(
    k8s_cluster: LocalCluster, k8s_namespace: str, k8s_fake_node: str, api: Any
) -> None:
    core, batch = client.CoreV1Api(api), client.BatchV1Api(api)
    batch.create_namespaced_job(k8s_namespace, make_indexed_job("flaky", k8s_fake_node, 1))

    def one_running() -> client.V1Pod | None:
        pods = [p for p in job_pods(core, k8s_namespace, "flaky") if p.status.phase == "Running"]
        return pods[0] if len(pods) == 1 else None

    first = eventually(one_running, "the first pod Running")
    k8s_cluster.fail_pod(k8s_namespace, first.metadata.name)

    def failed() -> bool:
        pod = core.read_namespaced_pod(first.metadata.name, k8s_namespace)
        return bool(pod.status.phase == "Failed")

    eventually(failed, "kwok to fail the labelled pod")

    def replacement() -> client.V1Pod | None:
        pod = one_running()
        return pod if pod is not None and pod.metadata.uid != first.metadata.uid else None

    # The Job controller recreates failed pods after its back-off (10 s for the first failure).
    second = eventually(replacement, "the Job controller's replacement pod Running")
    assert second.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "0"
    assert batch.read_namespaced_job_status("flaky", k8s_namespace).status.failed == 1


def test_token_request_with_custom_audience_passes_token_review(
    k8s_namespace: str, api: Any
) -> None:
    core, authn = client.CoreV1Api(api), client.AuthenticationV1Api(api)
    core.create_namespaced_service_account(
        k8s_namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="trainer"))
    )
    token = core.create_namespaced_service_account_token(
        "trainer",
        k8s_namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=["strata-sidecar"], expiration_seconds=600)
        ),
    ).status.token

    review = authn.create_token_review(
        client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=["strata-sidecar"])
        )
    )
    assert review.status.authenticated is True
    assert review.status.user.username == f"system:serviceaccount:{k8s_namespace}:trainer"
    assert review.status.audiences == ["strata-sidecar"]

    wrong = authn.create_token_review(
        client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=["other"]))
    )
    assert not wrong.status.authenticated


def _port_closed(url: str) -> bool:
    host, port = url.removeprefix("https://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_stop_leaves_no_process_behind(k8s_binaries: Binaries, tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "c", k8s_binaries)
    cluster.start()
    pids = cluster.pids()
    assert set(pids) == {
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    }
    assert all(pid_alive(pid) for pid in pids.values())
    cluster.stop()
    assert [name for name, pid in pids.items() if pid_alive(pid)] == []
    assert _port_closed(cluster.server)
    assert not cluster.state_file.exists()


def test_cluster_command_line_up_status_down(tmp_path: Path, k8s_binaries: Binaries) -> None:
    directory = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "e2e.cluster", *args, "--dir", str(directory)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    up = cli("up")
    assert up.returncode == 0, up.stderr + up.stdout
    assert "control plane ready in" in up.stdout
    pids = {
        n: c["pid"]
        for n, c in json.loads((directory / "state.json").read_text())["components"].items()
    }
    try:
        status = cli("status")
        assert status.returncode == 0, status.stdout
        assert "readyz: ok" in status.stdout
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert [name for name, pid in pids.items() if pid_alive(pid)] == []
    assert cli("status").returncode == 1
