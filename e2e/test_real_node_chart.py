"""A JobSet on the real node: the real JobSet controller's pod is injected, its trainer is
SIGKILLed and restores from RAM, and ``kubectl strata status / describe / verify job`` show what
the trainer saw.

Real parts: the control plane, the kubelet v1.35.4 with containerd/runc and the CNI bridge
(`e2e.node.harness`), Strata's sidecar and trainer images built from their Dockerfiles, the
JobSet controller v0.9.1 with its webhooks (`e2e.workloads`), the Job controller, the operator
as a local process whose report receiver listens on the bridge gateway (`e2e.node.operator`:
the sidecar's reports travel over the pod network), the kernel's tmpfs for the RAM tier, a
hostPath PV for the PVC tier, the real ``kubectl`` running the ``kubectl-strata`` plugin. The
verify Job's pod runs the sidecar image's ``strata verify`` on the real node, the claim mounted
read-only by the kubelet. Flow:

* a JobSet annotated with the policy: Strata's workload webhook labels its pod template, the
  JobSet and Job controllers create the pod, the webhook injects it, it runs on the real node;
* SIGKILL of the trainer's process: the kubelet restarts the container and it restores from RAM
  the newest step saved, with the bytes saved (`e2e.test_real_node.sigkill_trainer_and_restore`);
* ``kubectl strata status`` (JSON and table) and ``describe job`` show the job's restore (that
  step, from RAM) and its newest RAM and PVC steps, which are steps the trainer saved; ``verify
  job`` creates a Job whose pod lands on the real node (the job's nodeSelector and tolerations),
  finds every PVC copy intact, the newest PVC step among them, and exits 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import REAL_NODE_NAME, LocalCluster
from e2e.node.fixtures import real_node, strata_images  # noqa: F401 - fixtures
from e2e.node.harness import NODE_SELECTOR, TOLERATION, RealNode
from e2e.node.operator import NodeOperator, node_operator  # noqa: F401 - fixture
from e2e.node.story import (
    PVC_EVERY,
    container_status,
    kubectl_json,
    pod_events,
    saved_events,
    setup_pvc,
    sigkill_trainer_and_restore,
    trainer_pod,
    wait_for,
    wait_running,
)
from e2e.test_kubectl_strata import kubectl_strata, plugin_env  # noqa: F401 - fixture
from e2e.test_real_node_pods import apply_policy, job_status, report
from e2e.test_workloads import JOBSET_NAME_LABEL, jobset_controller  # noqa: F401 - fixture
from e2e.workloads import JobSetController
from strata_operator.constants import INJECTED_ANNOTATION, POLICY_LABEL, SIDECAR_NAME
from strata_operator.kubectl.verify import VERIFY_LABEL

pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(1500)]

POLICY = "fast"
JOBSET = "llm"


def real_node_jobset(name: str, steps: int) -> dict[str, Any]:
    """A JobSet of one Job of one pod (one rank), annotated with the policy; its pod template
    is `trainer_pod`'s (the trainer image, torch from the host, pinned to the real node) with
    ``restartPolicy: OnFailure`` so that the kubelet restarts a killed trainer in place."""
    pod = trainer_pod("unused", "unused", steps)
    spec = pod["spec"]
    assert spec["restartPolicy"] == "OnFailure"
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "annotations": {POLICY_LABEL: POLICY}},
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": 1,
                            "completions": 1,
                            # With OnFailure, container restarts count against backoffLimit.
                            "backoffLimit": 4,
                            "completionMode": "Indexed",
                            "template": {"spec": spec},
                        }
                    },
                }
            ],
        },
    }


def plugin_json(env: dict[str, str], *args: str) -> Any:
    proc = kubectl_strata(env, *args, "-o", "json")
    assert proc.returncode == 0, (args, proc.returncode, proc.stderr)
    return json.loads(proc.stdout)


def test_jobset_pod_on_the_real_node_restores_from_ram_and_kubectl_strata_shows_it(
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    real_node: RealNode,  # noqa: F811
    node_operator: NodeOperator,  # noqa: F811
    jobset_controller: JobSetController,  # noqa: F811
    plugin_env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    cluster, ns, node = k8s_cluster, k8s_namespace, real_node
    job_id = f"{ns}.{JOBSET}"
    setup_pvc(cluster, ns, tmp_path / "pvc")
    apply_policy(cluster, ns, POLICY)
    begin = time.monotonic()
    created = json.loads(
        cluster.kubectl(
            "-n", ns, "create", "-o", "json", "-f", "-",
            input=json.dumps(real_node_jobset(JOBSET, 2000)),
        )
    )  # fmt: skip
    # Strata's workload webhook labelled the pod template with the policy.
    template = created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["labels"][POLICY_LABEL] == POLICY

    # --- 1. the controllers' pod, injected, on the real node
    def the_pod() -> str | None:
        items = kubectl_json(
            cluster, "-n", ns, "get", "pods", "-l", f"{JOBSET_NAME_LABEL}={JOBSET}"
        )
        names = [p["metadata"]["name"] for p in items["items"]]
        return names[0] if len(names) == 1 else None

    name = wait_for("the JobSet's pod", the_pod, timeout=120)
    pod = wait_running(cluster, ns, name)
    running_s = time.monotonic() - begin
    assert pod["spec"]["nodeName"] == REAL_NODE_NAME
    assert any(o["kind"] == "Job" for o in pod["metadata"]["ownerReferences"])
    assert pod["metadata"]["annotations"][INJECTED_ANNOTATION] == POLICY
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    assert sidecar["restartPolicy"] == "Always"
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    strata_config = next(e for e in trainer["env"] if e["name"] == "STRATA_CONFIG")
    assert json.loads(strata_config["value"])["job_id"] == job_id

    wait_for("three RAM saves", lambda: len(saved_events(cluster, ns, name)) >= 3, timeout=240)
    first = pod_events(cluster, ns, name)
    assert first[0]["event"] == "restored" and first[0]["step"] is None, first[0]
    killed = sigkill_trainer_and_restore(cluster, ns, node, name, pod)
    restored = killed.restored
    step = restored["step"]

    # --- 2. kubectl strata shows what the trainer saw
    def restore_reported() -> dict[str, Any] | None:
        job = job_status(cluster, ns, POLICY, job_id) or {}
        last = job.get("lastRestore") or {}
        return job if last.get("outcome") == "restored" and last.get("step") == step else None

    try:
        wait_for("the restore in the policy status", restore_reported, timeout=120)
    except AssertionError:
        raise AssertionError(
            f"no restore of {job_id} at step {step} in the status: "
            f"{job_status(cluster, ns, POLICY, job_id)}; sidecar log:\n"
            f"{cluster.kubectl('-n', ns, 'logs', name, '-c', SIDECAR_NAME, check=False)}"
        ) from None

    def saved() -> set[int]:
        """Steps the trainer saved, before the kill and since: read after each plugin call, it
        holds every step the plugin can have shown (the trainer keeps training)."""
        return set(killed.saved) | {e["step"] for e in saved_events(cluster, ns, name)}

    docs = [d for d in plugin_json(plugin_env, "status", "-n", ns) if d["policy"] == POLICY]
    assert len(docs) == 1, docs
    by_job = {j["jobId"]: j for j in docs[0]["jobs"]}
    entry = by_job[job_id]
    assert entry["lastRestore"]["tier"] == "ram" and entry["lastRestore"]["step"] == step, entry
    newest = entry["newestCompleteStep"]
    steps = saved()
    assert newest["ram"] in steps and newest["ram"] >= step, (newest, sorted(steps))
    assert newest["pvc"] in steps and newest["pvc"] % PVC_EVERY == 0, (newest, sorted(steps))
    assert docs[0]["unprotectedPods"] == []

    proc = kubectl_strata(plugin_env, "status", POLICY, "-n", ns)
    assert proc.returncode == 0, proc.stderr
    assert job_id in proc.stdout and f"step {step} from ram" in proc.stdout, proc.stdout

    desc = plugin_json(plugin_env, "describe", "job", job_id, "-n", ns)
    assert desc["policy"] == POLICY and desc["namespace"] == ns
    assert desc["lastRestore"]["tier"] == "ram" and desc["lastRestore"]["step"] == step, desc
    assert desc["newestCompleteStep"]["pvc"] in saved(), desc
    (described,) = desc["pods"]
    assert described["name"] == name and described["injected"] is True, desc
    assert described["node"] == REAL_NODE_NAME and described["restarts"] >= 1, desc

    # verify: a Job on the real node (the training pod's nodeSelector and tolerations) reading
    # the claim read-only; every copy intact, the newest PVC step the status names among them.
    pvc_step = desc["newestCompleteStep"]["pvc"]
    verify_began = time.monotonic()
    proc = kubectl_strata(
        plugin_env, "verify", "job", job_id, "-n", ns, "-o", "json", "--timeout", "300",
        timeout=360,
    )  # fmt: skip
    verify_s = time.monotonic() - verify_began
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "every copy intact" in proc.stderr, proc.stderr
    result = json.loads(proc.stdout)
    assert result["summary"]["bad"] == 0, result["summary"]
    ok_steps = {r["step"] for r in result["copies"] if r["status"] == "ok" and r["job"] == job_id}
    assert pvc_step in ok_steps, (pvc_step, result)
    verify_pods = kubectl_json(cluster, "-n", ns, "get", "pods", "-l", VERIFY_LABEL)["items"]
    assert len(verify_pods) == 1, verify_pods
    verify_pod = verify_pods[0]
    assert verify_pod["spec"]["nodeName"] == REAL_NODE_NAME
    assert verify_pod["spec"]["nodeSelector"] == NODE_SELECTOR
    assert TOLERATION in verify_pod["spec"]["tolerations"]
    assert POLICY_LABEL not in verify_pod["metadata"].get("labels", {})
    assert container_status(verify_pod, "verify")["state"]["terminated"]["exitCode"] == 0

    report(
        request,
        f"JobSet pod Running {running_s:.1f} s after create; kubelet restart after SIGKILL "
        f"{killed.restart_s:.1f} s; restored step {step} from {restored['tier']} in "
        f"{restored['seconds']} s, {killed.restore_s:.1f} s after the kill; kubectl strata "
        f"verify job (a Job on the real node) {verify_s:.1f} s, {len(result['copies'])} copies",
    )
