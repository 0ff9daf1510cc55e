"""The steps of the real-node stories, shared by the tests (``e2e/test_real_node*.py``) and
``make demo-cluster`` (`e2e.demo_cluster`): the checkpoint policy (RAM every `RAM_EVERY` steps,
PVC every `PVC_EVERY`), a hostPath PVC, the trainer pod and waiting for it to run, reading the
trainer's JSON events from its log, SIGKILLing the trainer and checking its RAM restore,
deleting a pod while keeping the saves it logged, waiting for a ``restored`` event, and the
operator's view of a job in the policy status.

Every wait polls (`wait_for`) and raises AssertionError naming what it waited for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from e2e.cluster import LocalCluster
from e2e.node.harness import NODE_SELECTOR, TOLERATION, RealNode
from strata_operator.constants import POLICY_LABEL, RUN_ID_ANNOTATION

SIDECAR_IMAGE = "strata.dev/sidecar:e2e"
TRAINER_IMAGE = "strata.dev/trainer:e2e"
STEP_SECONDS = 0.5
RAM_EVERY = 2
PVC_EVERY = 4


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 180.0) -> Any:
    """Poll ``predicate`` every 0.5 s until it returns a true value (returned); raises
    AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def torch_site_packages() -> Path:
    import torch

    return Path(torch.__file__).resolve().parent.parent


def kubectl_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json"))


# ----------------------------------------------------------------------------- objects


def checkpoint_policy(
    name: str, *, namespace: str | None = None, sidecar_image: str | None = None
) -> dict[str, Any]:
    """The stories' CheckpointPolicy ``name``: RAM (a 64 MiB Memory emptyDir, keep 2) every
    `RAM_EVERY` steps, the PVC ``ckpt`` every `PVC_EVERY` (keep 3), a fresh start allowed, a
    30 s grace period. ``sidecar_image`` None: the operator's default (the chart's image)."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    sidecar: dict[str, Any] = {"terminationGracePeriodSeconds": 30}
    if sidecar_image is not None:
        sidecar = {"image": sidecar_image, **sidecar}
    return {
        "apiVersion": "strata.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": metadata,
        "spec": {
            "tiers": {
                "ram": {
                    "medium": "Memory",
                    "sizeLimit": "64Mi",
                    "keep": 2,
                    "every": {"steps": RAM_EVERY},
                },
                "pvc": {"claimName": "ckpt", "every": {"steps": PVC_EVERY}, "keep": 3},
            },
            "restore": {"allowFreshStart": True},
            "sidecar": sidecar,
        },
    }


def trainer_pod_spec(
    name: str,
    run_id: str,
    policy: str,
    args: list[str],
    *,
    command: list[str] | None = None,
    restart_policy: str = "OnFailure",
    grace_seconds: int | None = None,
    host_mounts: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """A pod ``name`` of run ``run_id`` labelled for ``policy`` on the real node: one container
    ``trainer`` (`TRAINER_IMAGE`, non-root, read-only root) with torch from the host's
    site-packages at ``/host-torch``, each of ``host_mounts`` (volume name -> host directory)
    read-only at ``/host-<name>`` and a writable ``/tmp``."""
    extra = host_mounts or {}
    spec: dict[str, Any] = {"restartPolicy": restart_policy}
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    container: dict[str, Any] = {
        "name": "trainer",
        "image": TRAINER_IMAGE,
        "imagePullPolicy": "Never",
    }
    if command is not None:
        container["command"] = command
    container.update(
        {
            "args": args,
            "env": [{"name": "PYTHONPATH", "value": "/host-torch"}],
            "securityContext": {
                "runAsNonRoot": True,
                "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": [
                {"name": "torch", "mountPath": "/host-torch", "readOnly": True},
                *({"name": v, "mountPath": f"/host-{v}", "readOnly": True} for v in extra),
                # torch needs a writable temporary directory at import time.
                {"name": "tmp", "mountPath": "/tmp"},
            ],
        }
    )
    spec.update(
        {
            "nodeSelector": NODE_SELECTOR,
            "tolerations": [TOLERATION],
            "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
            "containers": [container],
            "volumes": [
                {
                    "name": "torch",
                    "hostPath": {"path": str(torch_site_packages()), "type": "Directory"},
                },
                *(
                    {"name": v, "hostPath": {"path": str(p), "type": "Directory"}}
                    for v, p in extra.items()
                ),
                {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
            ],
        }
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {POLICY_LABEL: policy},
            "annotations": {RUN_ID_ANNOTATION: run_id},
        },
        "spec": spec,
    }


# ----------------------------------------------------------------------------- the trainer's log


def pod_events(
    cluster: LocalCluster, ns: str, pod: str, previous: bool = False
) -> list[dict[str, Any]]:
    """The JSON events (one a line) in the log of ``pod``'s trainer container (``previous``: of
    its previous run)."""
    args = ["-n", ns, "logs", pod, "-c", "trainer"]
    if previous:
        args.append("--previous")
    text = cluster.kubectl(*args, check=False)
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def saved_events(
    cluster: LocalCluster, ns: str, pod: str, previous: bool = False
) -> list[dict[str, Any]]:
    return [e for e in pod_events(cluster, ns, pod, previous) if e["event"] == "saved" and e["ok"]]


def wait_restored_event(
    cluster: LocalCluster, ns: str, pod: str, what: str = "the restored event", timeout: float = 180
) -> dict[str, Any]:
    """The first ``restored`` event of ``pod``'s trainer, once it logged one."""
    return wait_for(  # type: ignore[no-any-return]
        what,
        lambda: next((e for e in pod_events(cluster, ns, pod) if e["event"] == "restored"), None),
        timeout=timeout,
    )


@dataclass
class Deleted:
    """What `delete_pod_keeping_saves` saw: the steps the trainer logged as saved
    (``{step: weights_sha256}``), the monotonic time the deletion was asked for, and seconds
    from then to the pod being gone."""

    saved: dict[int, str]
    asked_at: float
    gone_s: float


def delete_pod_keeping_saves(cluster: LocalCluster, ns: str, name: str) -> Deleted:
    """Delete pod ``name`` and wait (120 s) until it is gone, reading its trainer's saves while
    it still has a log (the trainer exits on SIGTERM; its log goes with the pod)."""
    asked_at = time.monotonic()
    cluster.kubectl("-n", ns, "delete", "pod", name, "--wait=false")
    saves: list[dict[str, Any]] = []

    def gone() -> bool:
        nonlocal saves
        current = saved_events(cluster, ns, name)
        if len(current) >= len(saves):
            saves = current
        return not cluster.kubectl(
            "-n", ns, "get", "pod", name, "--ignore-not-found", check=False
        ).strip()

    wait_for("the pod to be deleted", gone, timeout=120)
    gone_s = time.monotonic() - asked_at
    return Deleted({e["step"]: e["weights_sha256"] for e in saves}, asked_at, gone_s)


# ----------------------------------------------------------------------------- the policy status


class JsonKubectl(Protocol):
    def kubectl_json(self, *args: str) -> Any: ...


def policy_job(kube: JsonKubectl, ns: str, policy: str, job_id: str) -> dict[str, Any]:
    """``status.jobs[]`` entry of ``job_id`` in CheckpointPolicy ``policy`` ({} when none)."""
    obj = kube.kubectl_json("-n", ns, "get", "checkpointpolicy", policy)
    for job in (obj.get("status") or {}).get("jobs") or []:
        if job.get("jobId") == job_id:
            return dict(job)
    return {}


def wait_restore_folded(
    kube: JsonKubectl, ns: str, policy: str, job_id: str, step: int, timeout: float = 120
) -> dict[str, Any]:
    """Wait until the operator folded the restore of ``step`` into the policy status; returns
    the job's status entry."""

    def done() -> dict[str, Any] | None:
        job = policy_job(kube, ns, policy, job_id)
        last = job.get("lastRestore") or {}
        return job if last.get("outcome") == "restored" and last.get("step") == step else None

    return wait_for(  # type: ignore[no-any-return]
        f"the restore of step {step} in the policy status", done, timeout=timeout
    )


def setup_pvc(cluster: LocalCluster, ns: str, path: Path) -> None:
    """A ReadWriteMany hostPath PV + a PVC ``ckpt`` bound to it."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"ckpt-{ns}"[:63]},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "manual",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(path), "type": "Directory"},
            "claimRef": {"namespace": ns, "name": "ckpt"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "ckpt", "namespace": ns},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "manual",
            "volumeName": pv["metadata"]["name"],  # type: ignore[index]
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}),
    )
    wait_for(
        "the PVC to be Bound",
        lambda: (
            kubectl_json(cluster, "-n", ns, "get", "pvc", "ckpt")["status"].get("phase") == "Bound"
        ),
    )


def trainer_pod(name: str, run_id: str, steps: int) -> dict[str, Any]:
    return trainer_pod_spec(
        name, run_id, "fast", ["--steps", str(steps), "--step-seconds", str(STEP_SECONDS)]
    )


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    status = pod.get("status") or {}
    for s in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        if s["name"] == name:
            return dict(s)
    return {}


def wait_running(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        pod = kubectl_json(cluster, "-n", ns, "get", "pod", name)
        ok = (pod.get("status") or {}).get("phase") == "Running" and container_status(
            pod, "trainer"
        ).get("state", {}).get("running")
        return pod if ok else None

    try:
        return wait_for(f"pod {name} Running", running, timeout=240)  # type: ignore[no-any-return]
    except AssertionError:
        pod = kubectl_json(cluster, "-n", ns, "get", "pod", name)
        raise AssertionError(
            f"pod {name} not Running: {json.dumps(pod.get('status'), indent=1)}"
        ) from None


@dataclass
class Sigkilled:
    """What `sigkill_trainer_and_restore` saw: the trainer's ``restored`` event after the
    restart, the steps it saved before the kill (``{step: weights_sha256}``), and seconds from
    the kill to the restarted container running and to the restored event."""

    restored: dict[str, Any]
    saved: dict[int, str]
    restart_s: float
    restore_s: float


def sigkill_trainer_and_restore(
    cluster: LocalCluster, ns: str, node: RealNode, name: str, pod: dict[str, Any]
) -> Sigkilled:
    """SIGKILL the trainer container's PID 1 of the running pod ``name`` (``pod``: its object)
    through containerd, wait for the kubelet to restart it and for its ``restored`` event, and
    assert it restored from RAM the newest step saved before the kill (or the one before it,
    when the kill hit a save still being copied) with the bytes saved."""
    # SIGKILL the trainer's process (the container's PID 1) through containerd.
    cid = container_status(pod, "trainer")["containerID"].split("://", 1)[1]
    saves_before = saved_events(cluster, ns, name)
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    killed = time.monotonic()

    def restarted() -> dict[str, Any] | None:
        p = kubectl_json(cluster, "-n", ns, "get", "pod", name)
        st = container_status(p, "trainer")
        return p if st.get("restartCount", 0) >= 1 and st.get("state", {}).get("running") else None

    pod = wait_for("the kubelet to restart the trainer", restarted, timeout=120)
    restart_s = time.monotonic() - killed
    term = container_status(pod, "trainer")["lastState"]["terminated"]
    assert term["exitCode"] == 137, term
    saves = saved_events(cluster, ns, name, previous=True)
    assert len(saves) >= len(saves_before)
    restored = wait_restored_event(cluster, ns, name)
    restore_s = time.monotonic() - killed
    by_step = {e["step"]: e["weights_sha256"] for e in saves}
    newest = max(by_step)
    assert restored["tier"] == "ram", restored
    # The newest saved step (a save still being copied at the kill may not be committed: then
    # the one before it).
    assert restored["step"] in (newest, newest - RAM_EVERY), (restored, sorted(by_step))
    assert restored["weights_sha256"] == by_step[restored["step"]]
    return Sigkilled(restored, by_step, restart_s, restore_s)
