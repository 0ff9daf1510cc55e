"""End to end on the local control plane: policy -> workloads -> injected pods -> real sidecars and
trainers -> policy status -> a pod failed through kwok -> replacement injected -> restore from the
nearest tier -> status and an Event show the restore's tier and step.

Real parts: kube-apiserver, kube-controller-manager (the Job controller creates and replaces the
indexed Job's pods), kube-scheduler, kwok (pods Running / Failed on a fake node), the operator as
a subprocess (webhook over TLS, report receiver with TokenReview), ``strata sidecar`` and
``e2e/small_trainer.py`` (torch, ``strata.Checkpointer``, gloo with two ranks) as processes, /dev/shm as the RAM tier, a local
directory as the PVC. ``e2e.local_kubelet`` stands in for the kubelet that kwok fakes: it runs the
containers from the pod spec the apiserver stored (after injection).

JobSet and PyTorchJob: no workload controller runs in this test (``e2e/test_workloads.py`` runs the
real JobSet controller and training-operator); it creates their pods from the (webhook-labelled)
templates with the labels those controllers set, and checks they are injected.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from tests.fixtures.pods import jobset_obj, pytorchjob_obj

from e2e.cluster import LocalCluster
from e2e.local_kubelet import LocalKubelet, LocalPod, free_port
from e2e.operator_fixtures import OperatorProcess
from strata_operator.admission.mutation import INJECTED_ANNOTATION, POLICY_LABEL, SIDECAR_NAME

pytestmark = pytest.mark.e2e

TRAIN = str(Path(__file__).resolve().parent / "small_trainer.py")
STEP_SECONDS = 0.8
PVC_EVERY = 4
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def kubelet(api: client.ApiClient, tmp_path: Path) -> Iterator[LocalKubelet]:
    shm = Path("/dev/shm") / f"strata-e2e-flow-{uuid.uuid4().hex[:8]}"
    k = LocalKubelet(api, tmp_path, shm)
    try:
        yield k
    finally:
        k.close()


def events(trainer_log: str) -> list[dict[str, Any]]:
    out = []
    for line in trainer_log.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def wait_exit(local: LocalPod, key: str, timeout: float = 240.0) -> list[dict[str, Any]]:
    proc = local.procs[key]
    try:
        code = proc.wait(timeout)
    except Exception:
        proc.kill()
        raise
    assert code == 0, f"{key} of {local.name} exited {code}:\n{local.log_text(key)[-4000:]}"
    return events(local.log_text(key))


def setup_pvc(api: client.ApiClient, ns: str, path: Path) -> None:
    """A ReadWriteMany PV + bound PVC named ``ckpt`` (the scheduler needs it bound)."""
    core = client.CoreV1Api(api)
    pv_name = f"ckpt-{ns}"[:63]
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "manual",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(path)},
                "claimRef": {"namespace": ns, "name": "ckpt"},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "ckpt"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "manual",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    wait_for(
        "the PVC to be Bound",
        lambda: (
            core.read_namespaced_persistent_volume_claim(  # type: ignore[no-any-return]
                "ckpt", ns
            ).status.phase
            == "Bound"
        ),
    )


def policy(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "strata.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": {"name": "fast", "namespace": ns},
        "spec": {
            "tiers": {
                "ram": {"medium": "Memory", "sizeLimit": "64Mi", "keep": 2},
                "pvc": {"claimName": "ckpt", "every": {"steps": PVC_EVERY}, "keep": 3},
            },
            "restore": {"allowFreshStart": True},
            "sidecar": {"terminationGracePeriodSeconds": 60},
        },
    }


def training_job(name: str) -> dict[str, Any]:
    """An indexed Job of two ranks (gloo); RANK from the completion index (downward API)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "annotations": {POLICY_LABEL: "fast"}},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 6,
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
                                            "fieldPath": f"metadata.annotations['{INDEX_LABEL}']"
                                        }
                                    },
                                },
                                {"name": "WORLD_SIZE", "value": "2"},
                                {"name": "MASTER_ADDR", "value": "127.0.0.1"},
                            ],
                        }
                    ],
                }
            },
        },
    }


def job_pods(api: client.ApiClient, ns: str, job: str) -> list[dict[str, Any]]:
    resp = client.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"batch.kubernetes.io/job-name={job}", _preload_content=False
    )
    return list(json.loads(resp.data)["items"])


def read_pod(api: client.ApiClient, ns: str, name: str) -> dict[str, Any]:
    resp = client.CoreV1Api(api).read_namespaced_pod(name, ns, _preload_content=False)
    data: dict[str, Any] = json.loads(resp.data)
    return data


def running(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    pod = read_pod(api, ns, name)
    return pod if (pod.get("status") or {}).get("phase") == "Running" else None


def assert_injected(pod: dict[str, Any]) -> None:
    assert pod["metadata"]["annotations"].get(INJECTED_ANNOTATION) == "fast", pod["metadata"]
    names = [c["name"] for c in pod["spec"].get("initContainers") or []]
    assert SIDECAR_NAME in names, names


def policy_obj(api: client.ApiClient, ns: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", "fast"
    )
    return obj


def job_status(api: client.ApiClient, ns: str, job_id: str) -> dict[str, Any] | None:
    for job in (policy_obj(api, ns).get("status") or {}).get("jobs") or []:
        if job["jobId"] == job_id:
            return dict(job)
    return None


def start_pod(kubelet: LocalKubelet, pod: dict[str, Any]) -> LocalPod:
    local = kubelet.admit(pod)
    kubelet.run_sidecar(local, SIDECAR_NAME)
    return local


def train(kubelet: LocalKubelet, local: LocalPod, steps: int, port: int, tag: str) -> None:
    kubelet.run(
        local,
        local.pod["spec"]["containers"][0]["name"],
        [sys.executable, TRAIN, "--steps", str(steps), "--step-seconds", str(STEP_SECONDS)],
        extra_env={"MASTER_PORT": str(port)},
        tag=tag,
    )


def test_flow_job_and_jobset_checkpoint_fail_and_restore_from_nearest_tier(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    k8s_fake_node: str,
    workload_crds: dict[str, str],
    kubelet: LocalKubelet,
) -> None:
    ns = k8s_namespace
    custom = client.CustomObjectsApi(api)
    setup_pvc(api, ns, kubelet.pvc_root / "ckpt")
    custom.create_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", policy(ns)
    )
    wait_for(
        "the policy to be Ready",
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (policy_obj(api, ns).get("status") or {}).get("conditions") or []
        ),
    )

    # --- workloads: an indexed Job (real Job controller), a JobSet and a PyTorchJob
    client.BatchV1Api(api).create_namespaced_job(ns, training_job("pretrain"))
    js = custom.create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", ns, "jobsets", jobset_obj("llm", policy="fast")
    )
    js_template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert js_template["metadata"]["labels"][POLICY_LABEL] == "fast"
    js_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llm-workers-0-0",
            "labels": {
                **js_template["metadata"]["labels"],
                # What the JobSet controller (and the Job controller beneath it) would set.
                "jobset.sigs.k8s.io/jobset-name": "llm",
                "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                "jobset.sigs.k8s.io/job-index": "0",
                "batch.kubernetes.io/job-name": "llm-workers-0",
                INDEX_LABEL: "0",
            },
        },
        "spec": js_template["spec"],
    }
    client.CoreV1Api(api).create_namespaced_pod(ns, js_pod)
    pt = custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", ns, "pytorchjobs", pytorchjob_obj("bert", policy="fast", workers=1)
    )
    for rtype in ("Master", "Worker"):
        tmpl = pt["spec"]["pytorchReplicaSpecs"][rtype]["template"]
        assert tmpl["metadata"]["labels"][POLICY_LABEL] == "fast"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"bert-{rtype.lower()}-0",
                "labels": {
                    **tmpl["metadata"]["labels"],
                    "training.kubeflow.org/job-name": "bert",
                    "training.kubeflow.org/replica-type": rtype.lower(),
                    "training.kubeflow.org/replica-index": "0",
                },
            },
            "spec": tmpl["spec"],
        }
        created = client.CoreV1Api(api).create_namespaced_pod(ns, pod, _preload_content=False)
        stored = json.loads(created.data)
        assert_injected(stored)
        env = {e["name"] for e in stored["spec"]["containers"][0]["env"]}
        assert {"STRATA_REPLICA_TYPE", "STRATA_REPLICA_INDEX"} <= env
        config = next(
            e["value"]
            for e in stored["spec"]["containers"][0]["env"]
            if e["name"] == "STRATA_CONFIG"
        )
        assert json.loads(config)["job_id"] == f"{ns}.bert"

    # --- the Job's pods, created by the Job controller, injected by the webhook, Running (kwok)
    pods = wait_for("two Running pods of the Job", lambda: _running_job_pods(api, ns, 2))
    by_rank = {int(p["metadata"]["annotations"][INDEX_LABEL]): p for p in pods}
    for p in by_rank.values():
        assert_injected(p)
    js_stored = wait_for("the JobSet pod Running", lambda: running(api, ns, "llm-workers-0-0"))
    assert_injected(js_stored)

    local = {rank: start_pod(kubelet, p) for rank, p in by_rank.items()}
    js_local = start_pod(kubelet, js_stored)
    port = free_port()
    for rank in (0, 1):
        train(kubelet, local[rank], 12, port, "trainer-1")
    train(kubelet, js_local, 8, free_port(), "trainer-1")
    for rank in (0, 1):
        first = wait_exit(local[rank], "trainer-1")
        assert first[0]["event"] == "restored" and first[0]["step"] is None  # fresh start
    wait_exit(js_local, "trainer-1")

    # --- the policy status shows the committed steps per tier (reports over HTTPS)
    newest_pvc = 8  # steps 0, 4, 8 of 0..11 are due on the PVC
    wait_for(
        f"status: job {ns}.pretrain complete on the PVC at step {newest_pvc}",
        lambda: (
            (job_status(api, ns, f"{ns}.pretrain") or {}).get("newestCompleteStep", {}).get("pvc")
            == newest_pvc
        ),
    )
    wait_for(
        f"status: job {ns}.llm complete on the PVC at step 4",
        lambda: (
            (job_status(api, ns, f"{ns}.llm") or {}).get("newestCompleteStep", {}).get("pvc") == 4
        ),
    )

    # --- fail rank 1's pod through kwok; the Job controller replaces it; the webhook injects it
    failed = by_rank[1]["metadata"]["name"]
    k8s_cluster.fail_pod(ns, failed)
    wait_for("the pod Failed", lambda: read_pod(api, ns, failed)["status"].get("phase") == "Failed")
    # The kubelet stops a failed pod's sidecar with SIGTERM: it flushes its newest RAM step (C-14).
    assert kubelet.terminate(local[1], SIDECAR_NAME) == 0, local[1].log_text(SIDECAR_NAME)
    replacement = wait_for(
        "a Running replacement for index 1",
        lambda: next(
            (
                p
                for p in _running_job_pods(api, ns, 1, index="1") or []
                if p["metadata"]["name"] != failed
            ),
            None,
        ),
    )
    assert_injected(replacement)
    local[1] = start_pod(kubelet, replacement)

    # Both ranks resume (rank 0 in its surviving pod, rank 1 in the replacement) and agree on one
    # step; rank 1's RAM tier is new and empty, so it must come from a farther tier.
    port = free_port()
    for rank in (0, 1):
        train(kubelet, local[rank], 14, port, "trainer-2")
    resumed = {rank: wait_exit(local[rank], "trainer-2") for rank in (0, 1)}
    restored = {rank: resumed[rank][0] for rank in (0, 1)}
    assert all(r["event"] == "restored" for r in restored.values()), restored
    step = restored[1]["step"]
    assert step is not None and step >= newest_pvc, restored
    assert restored[0]["step"] == step
    assert restored[1]["tier"] == "pvc", restored
    assert restored[0]["tier"] in ("ram", "pvc"), restored
    assert resumed[1][-1]["event"] == "done"

    # --- status and an Event show the restore's tier and step
    def restore_event(rank: int) -> Any:
        evs = client.CoreV1Api(api).list_namespaced_event(
            ns, field_selector="involvedObject.name=fast,involvedObject.kind=CheckpointPolicy"
        )
        wanted = f"rank {rank} restored step {step} from tier"
        return next((e for e in evs.items if e.reason == "Restored" and wanted in e.message), None)

    events_by_rank = {
        rank: wait_for(f"a Restored Event for rank {rank}", lambda r=rank: restore_event(r), 60)
        for rank in (0, 1)
    }
    job = wait_for(
        "status.jobs[].lastRestore of the resumed run",
        lambda: (
            (s := job_status(api, ns, f"{ns}.pretrain"))
            and (s.get("lastRestore") or {}).get("step") == step
            and s
        ),
    )
    print("\n$ kubectl get ckpol -n", ns)
    print(k8s_cluster.kubectl("get", "ckpol", "-n", ns))
    print("$ kubectl describe ckpol fast -n", ns)
    print(k8s_cluster.kubectl("describe", "ckpol", "fast", "-n", ns))
    print(
        f"[flow] restored step {step}: rank 0 from {restored[0]['tier']} in "
        f"{restored[0]['seconds']} s, rank 1 from {restored[1]['tier']} in {restored[1]['seconds']} s"
    )
    # The Events and the status name the tier each rank's trainer actually restored from.
    for rank in (0, 1):
        assert f"from tier {restored[rank]['tier']}" in events_by_rank[rank].message, (
            rank,
            events_by_rank[rank].message,
        )
    assert events_by_rank[1].type == "Normal"
    assert job["lastRestore"]["tier"] in (restored[0]["tier"], restored[1]["tier"])


def _running_job_pods(
    api: client.ApiClient, ns: str, count: int, index: str | None = None
) -> list[dict[str, Any]] | None:
    pods = [
        p
        for p in job_pods(api, ns, "pretrain")
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and (index is None or p["metadata"]["annotations"].get(INDEX_LABEL) == index)
    ]
    return pods if len(pods) >= count else None
