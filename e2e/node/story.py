"""The steps of the real-node stories, shared by the tests (``e2e/test_real_node*.py``) and
``make demo-cluster`` (`e2e.demo_cluster`): the checkpoint policy (RAM every `RAM_EVERY` steps,
PVC every `PVC_EVERY`), the trainer pod, reading the trainer's JSON events from its log,
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
from e2e.node.harness import NODE_SELECTOR, TOLERATION
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
