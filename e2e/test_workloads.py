"""End to end with the REAL workload controllers: a JobSet and a PyTorchJob whose pod fails are
recreated by their own controllers, the Strata webhook injects the new pods again, and every rank
restores the same step.

Real parts: everything of ``e2e/test_flow.py`` (apiserver, controller-manager with the Job
controller and the garbage collector, scheduler, kwok, the operator as a subprocess, ``strata
sidecar`` and ``e2e/small_trainer.py`` with gloo), plus the JobSet controller (built from the
jobset v0.9.1 sources, its defaulting/validating webhooks registered) and the training-operator
v1.8.1 (PyTorchJob controller and its validating webhook), see `e2e.workloads`.

Ranks come only from what the controllers set: the JobSet template reads ``RANK`` from the pod
label ``jobset.sigs.k8s.io/job-index`` (downward API); the training-operator writes ``RANK`` and
``WORLD_SIZE`` into the pods itself. The local kubelet (`e2e.local_kubelet`) stands in for the
pod network only: ``MASTER_ADDR`` (a Service name the controllers choose) becomes 127.0.0.1 with a
free ``MASTER_PORT``.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import POD_FAIL_LABEL, BinariesMissing, LocalCluster
from e2e.fixtures import REQUIRE_E2E_ENV
from e2e.local_kubelet import LocalKubelet, LocalPod, free_port
from e2e.operator_fixtures import OperatorProcess
from e2e.test_flow import (
    assert_injected,
    job_status,
    policy,
    policy_obj,
    setup_pvc,
    start_pod,
    wait_exit,
    wait_for,
)
from e2e.workloads import (
    JobSetController,
    TrainingOperator,
    WorkloadController,
    locate_jobset,
    locate_training_operator,
)
from strata_operator.admission.mutation import POLICY_LABEL, SIDECAR_NAME

pytestmark = pytest.mark.e2e

TRAIN = str(Path(__file__).resolve().parent / "small_trainer.py")
STEP_SECONDS = 0.8
FIRST_STEPS = 12  # steps 0..11; the policy puts 0, 4, 8 on the PVC
NEWEST_PVC = 8
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
PT_JOB_NAME_LABEL = "training.kubeflow.org/job-name"
PT_TYPE_LABEL = "training.kubeflow.org/replica-type"
PT_INDEX_LABEL = "training.kubeflow.org/replica-index"


def _require(locate: Any, cluster: LocalCluster) -> WorkloadController:
    try:
        tool: WorkloadController = locate(cluster.bin_dir)
    except BinariesMissing as err:
        if os.environ.get(REQUIRE_E2E_ENV):
            pytest.fail(f"{err} ({REQUIRE_E2E_ENV} is set, so the e2e tests must run)")
        pytest.skip(f"{err} (set {REQUIRE_E2E_ENV}=1 to turn this skip into a failure)")
    return tool


@pytest.fixture(scope="module")
def jobset_controller(
    k8s_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JobSetController]:
    """The JobSet controller and its webhooks, for this module only."""
    tool = _require(locate_jobset, k8s_cluster)
    ctl = JobSetController(k8s_cluster, tool, tmp_path_factory.mktemp("jobset"))
    try:
        ctl.start()
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture(scope="module")
def training_operator(
    k8s_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TrainingOperator]:
    """The training-operator (PyTorchJob only) and its webhook, for this module only."""
    tool = _require(locate_training_operator, k8s_cluster)
    ctl = TrainingOperator(k8s_cluster, tool, tmp_path_factory.mktemp("training-operator"))
    try:
        ctl.start()
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture
def kubelet(api: client.ApiClient, tmp_path: Path) -> Iterator[LocalKubelet]:
    k = LocalKubelet(
        api, tmp_path, Path("/dev/shm") / f"strata-e2e-workloads-{uuid.uuid4().hex[:8]}"
    )
    try:
        yield k
    finally:
        k.close()


# --------------------------------------------------------------------------- helpers


def create_ready_policy(api: client.ApiClient, kubelet: LocalKubelet, ns: str) -> None:
    setup_pvc(api, ns, kubelet.pvc_root / "ckpt")
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", policy(ns)
    )
    wait_for(
        "the policy to be Ready",
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (policy_obj(api, ns).get("status") or {}).get("conditions") or []
        ),
    )


def pods(api: client.ApiClient, ns: str, selector: str) -> list[dict[str, Any]]:
    resp = client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=selector, _preload_content=False
    )
    return list(json.loads(resp.data)["items"])


def running_pods(
    api: client.ApiClient, ns: str, selector: str, count: int
) -> list[dict[str, Any]] | None:
    """Exactly ``count`` Running, not deleting pods matching ``selector``, else None."""
    found = [
        p
        for p in pods(api, ns, selector)
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]
    return found if len(found) == count else None


def pod_gone_or_failed(api: client.ApiClient, ns: str, uid: str) -> bool:
    for p in pods(api, ns, ""):
        if p["metadata"]["uid"] == uid:
            return bool(
                p["metadata"].get("deletionTimestamp")
                or (p.get("status") or {}).get("phase") == "Failed"
            )
    return True


def env_value(pod: dict[str, Any], name: str) -> Any:
    for e in pod["spec"]["containers"][0].get("env") or []:
        if e["name"] == name:
            return e.get("value", e.get("valueFrom"))
    return None


def train(kubelet: LocalKubelet, local: LocalPod, steps: int, port: int, tag: str) -> None:
    """Run the trainer in the pod's first container; the pod network is loopback here."""
    kubelet.run(
        local,
        local.pod["spec"]["containers"][0]["name"],
        [sys.executable, TRAIN, "--steps", str(steps), "--step-seconds", str(STEP_SECONDS)],
        extra_env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        tag=tag,
    )


def run_ranks(
    kubelet: LocalKubelet, local: dict[int, LocalPod], steps: int, tag: str
) -> dict[int, list[dict[str, Any]]]:
    port = free_port()
    for rank in sorted(local):
        train(kubelet, local[rank], steps, port, tag)
    return {rank: wait_exit(local[rank], tag) for rank in sorted(local)}


def restored_events(runs: dict[int, list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    out = {rank: events[0] for rank, events in runs.items()}
    assert all(e["event"] == "restored" for e in out.values()), out
    assert {e["rank"] for e in out.values()} == set(runs), out
    return out


def wait_pvc_step(api: client.ApiClient, ns: str, job_id: str, step: int) -> None:
    wait_for(
        f"status: job {job_id} complete on the PVC at step {step}",
        lambda: (
            (job_status(api, ns, job_id) or {}).get("newestCompleteStep", {}).get("pvc") == step
        ),
    )


# --------------------------------------------------------------------------- JobSet


def jobset(name: str, replicas: int, max_restarts: int) -> dict[str, Any]:
    """``replicas`` child Jobs of one pod each; RANK is the JobSet's job index (downward API)."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "annotations": {POLICY_LABEL: "fast"}},
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            "parallelism": 1,
                            "completions": 1,
                            "backoffLimit": 0,
                            "completionMode": "Indexed",
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [
                                        {
                                            "name": "trainer",
                                            "image": "ghcr.io/strata-dev/strata-train:0.1.0",
                                            "env": [
                                                {
                                                    "name": "RANK",
                                                    "valueFrom": {
                                                        "fieldRef": {
                                                            "fieldPath": "metadata.labels"
                                                            f"['{JOB_INDEX_LABEL}']"
                                                        }
                                                    },
                                                },
                                                {"name": "WORLD_SIZE", "value": str(replicas)},
                                                {
                                                    "name": "MASTER_ADDR",
                                                    "value": f"{name}-workers-0-0.{name}",
                                                },
                                            ],
                                        }
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def test_jobset_restart_by_the_real_controller_is_injected_again_and_every_rank_restores_one_step(
    operator_running: OperatorProcess,
    jobset_controller: JobSetController,
    api: client.ApiClient,
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    k8s_fake_node: str,
    kubelet: LocalKubelet,
) -> None:
    ns = k8s_namespace
    custom = client.CustomObjectsApi(api)
    create_ready_policy(api, kubelet, ns)
    created = custom.create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", ns, "jobsets", jobset("llm", replicas=2, max_restarts=2)
    )
    # Strata's workload webhook labelled the template; the JobSet webhook defaulted the object.
    template = created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["labels"][POLICY_LABEL] == "fast"
    assert created["spec"]["network"]["enableDNSHostnames"] is True, created["spec"]

    selector = f"{JOBSET_NAME_LABEL}=llm"
    first = wait_for("two Running JobSet pods", lambda: running_pods(api, ns, selector, 2))
    by_rank = {int(p["metadata"]["labels"][JOB_INDEX_LABEL]): p for p in first}
    assert sorted(by_rank) == [0, 1]
    for p in first:
        labels = p["metadata"]["labels"]
        assert labels[RESTART_LABEL] == "0" and labels[COMPLETION_INDEX_LABEL] == "0", labels
        assert any(o["kind"] == "Job" for o in p["metadata"]["ownerReferences"])
        assert_injected(p)
        # The operator wired the JobSet identity labels the controller really sets.
        assert env_value(p, "STRATA_JOBSET_JOB_INDEX") == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{JOB_INDEX_LABEL}']"}
        }
        assert json.loads(env_value(p, "STRATA_CONFIG"))["job_id"] == f"{ns}.llm"

    local = {rank: start_pod(kubelet, p) for rank, p in by_rank.items()}
    fresh = restored_events(run_ranks(kubelet, local, FIRST_STEPS, "trainer-1"))
    assert all(e["step"] is None for e in fresh.values()), fresh  # fresh start
    wait_pvc_step(api, ns, f"{ns}.llm", NEWEST_PVC)

    # --- rank 1's pod fails: its Job fails (backoffLimit 0) and the JobSet controller restarts
    # the whole JobSet: every Job and pod is deleted and created again (restart attempt 1).
    failed = by_rank[1]
    k8s_cluster.fail_pod(ns, failed["metadata"]["name"])
    for rank, p in by_rank.items():
        wait_for(
            f"the old pod of rank {rank} failed or deleted",
            lambda p=p: pod_gone_or_failed(api, ns, p["metadata"]["uid"]),
        )
        # The kubelet stops the pod's sidecar with SIGTERM: it flushes its newest RAM step.
        assert kubelet.terminate(local[rank], SIDECAR_NAME) == 0, local[rank].log_text(SIDECAR_NAME)
    second = wait_for(
        "two Running pods of restart attempt 1",
        lambda: running_pods(api, ns, f"{selector},{RESTART_LABEL}=1", 2),
        timeout=180,
    )
    old_names = {p["metadata"]["name"] for p in first}
    assert not old_names & {p["metadata"]["name"] for p in second}, "pods were not recreated"
    by_rank = {int(p["metadata"]["labels"][JOB_INDEX_LABEL]): p for p in second}
    assert sorted(by_rank) == [0, 1]
    for p in second:
        assert_injected(p)
    js = custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets", "llm")
    assert js["status"]["restarts"] == 1, js["status"]

    # --- every rank restores the same step; the new pods' RAM tiers are empty, so from the PVC
    local = {rank: start_pod(kubelet, p) for rank, p in by_rank.items()}
    runs = run_ranks(kubelet, local, FIRST_STEPS + 2, "trainer-2")
    restored = restored_events(runs)
    steps = {e["step"] for e in restored.values()}
    assert len(steps) == 1, restored
    step = steps.pop()
    assert step is not None and step >= NEWEST_PVC, restored
    assert all(e["tier"] == "pvc" for e in restored.values()), restored
    assert all(run[-1]["event"] == "done" for run in runs.values()), runs
    print(f"\n[jobset] restart attempt 1: ranks 0 and 1 restored step {step} from the PVC")


# --------------------------------------------------------------------------- PyTorchJob


def pytorchjob(name: str) -> dict[str, Any]:
    """One Master and one Worker; ``ExitCode``: a pod failing with a retryable code (>= 128) is
    deleted and created again by the controller."""

    def replica() -> dict[str, Any]:
        return {
            "replicas": 1,
            "restartPolicy": "ExitCode",
            "template": {
                "spec": {
                    "containers": [
                        {"name": "pytorch", "image": "ghcr.io/strata-dev/strata-train:0.1.0"}
                    ]
                }
            },
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "annotations": {POLICY_LABEL: "fast"}},
        "spec": {
            "runPolicy": {"backoffLimit": 3},
            "pytorchReplicaSpecs": {"Master": replica(), "Worker": replica()},
        },
    }


def test_pytorchjob_pod_recreated_by_the_real_controller_is_injected_again_and_ranks_agree(
    operator_running: OperatorProcess,
    training_operator: TrainingOperator,
    api: client.ApiClient,
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    k8s_fake_node: str,
    kubelet: LocalKubelet,
) -> None:
    ns = k8s_namespace
    custom = client.CustomObjectsApi(api)
    create_ready_policy(api, kubelet, ns)
    created = custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", ns, "pytorchjobs", pytorchjob("bert")
    )
    for spec in created["spec"]["pytorchReplicaSpecs"].values():
        assert spec["template"]["metadata"]["labels"][POLICY_LABEL] == "fast"

    selector = f"{PT_JOB_NAME_LABEL}=bert"
    first = wait_for("two Running PyTorchJob pods", lambda: running_pods(api, ns, selector, 2))
    # The controller's own RANK: 0 for the master, 1 + index for workers.
    by_rank = {int(env_value(p, "RANK")): p for p in first}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[0]["metadata"]["labels"][PT_TYPE_LABEL] == "master"
    assert by_rank[1]["metadata"]["labels"][PT_TYPE_LABEL] == "worker"
    for p in first:
        assert p["metadata"]["labels"][PT_INDEX_LABEL] == "0"
        assert env_value(p, "WORLD_SIZE") == "2"
        assert_injected(p)
        assert env_value(p, "STRATA_REPLICA_INDEX") == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{PT_INDEX_LABEL}']"}
        }
        assert json.loads(env_value(p, "STRATA_CONFIG"))["job_id"] == f"{ns}.bert"

    local = {rank: start_pod(kubelet, p) for rank, p in by_rank.items()}
    fresh = restored_events(run_ranks(kubelet, local, FIRST_STEPS, "trainer-1"))
    assert all(e["step"] is None for e in fresh.values()), fresh
    wait_pvc_step(api, ns, f"{ns}.bert", NEWEST_PVC)

    # --- the worker fails with a retryable exit code (137); the controller deletes the pod and
    # creates it again (same name, new uid)
    worker = by_rank[1]
    name, uid = worker["metadata"]["name"], worker["metadata"]["uid"]
    body = {
        "metadata": {
            "annotations": {
                f"{POD_FAIL_LABEL}/exit-code": "137",
                f"{POD_FAIL_LABEL}/container-name": "pytorch",
                f"{POD_FAIL_LABEL}/reason": "OOMKilled",
            }
        }
    }
    client.CoreV1Api(api).patch_namespaced_pod(name, ns, body)
    k8s_cluster.fail_pod(ns, name)
    wait_for("the worker failed or deleted", lambda: pod_gone_or_failed(api, ns, uid))
    assert kubelet.terminate(local[1], SIDECAR_NAME) == 0, local[1].log_text(SIDECAR_NAME)

    def recreated() -> dict[str, Any] | None:
        found = running_pods(api, ns, f"{selector},{PT_TYPE_LABEL}=worker", 1)
        return found[0] if found and found[0]["metadata"]["uid"] != uid else None

    replacement = wait_for("the worker recreated and Running", recreated, timeout=180)
    assert replacement["metadata"]["name"] == name
    assert env_value(replacement, "RANK") == "1"
    assert_injected(replacement)
    local[1] = start_pod(kubelet, replacement)

    # --- the master (surviving pod) and the new worker restore the same step; the worker's RAM
    # tier is new and empty, so its shard comes from the PVC
    runs = run_ranks(kubelet, local, FIRST_STEPS + 2, "trainer-2")
    restored = restored_events(runs)
    steps = {e["step"] for e in restored.values()}
    assert len(steps) == 1, restored
    step = steps.pop()
    assert step is not None and step >= NEWEST_PVC, restored
    assert restored[1]["tier"] == "pvc", restored
    assert restored[0]["tier"] in ("ram", "pvc"), restored
    assert all(run[-1]["event"] == "done" for run in runs.values()), runs
    print(f"\n[pytorchjob] worker recreated: ranks 0 and 1 restored step {step}")
