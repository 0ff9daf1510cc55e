"""``kubectl strata verify job JOB``: run ``strata verify`` where the data is.

A ``batch/v1`` Job in the job's namespace (the PVC is only mountable there) runs the sidecar
image's ``strata verify /strata/pvc [gs://BUCKET/PREFIX] --job JOB [--step S] -o FMT``, mounting
the policy's claim read-only (with its ``subPath``). GCS credentials: the ``--service-account``
given, else the service account of one of the job's pods (workload identity); a ``SecretRef``
key of the policy is mounted and named by ``GOOGLE_APPLICATION_CREDENTIALS``. The pod takes the
``nodeSelector`` and ``tolerations`` of one of the job's pods, so it runs where the job runs (a
tainted pool of training nodes, a claim reachable only there). The RAM tier is on each training node and is not verified here (a restore verifies it before it serves).

The pod carries no ``strata.dev/policy`` label, so the webhook leaves it alone; it runs as
non-root with the restricted Pod Security Standard's settings. The plugin waits for the pod to
finish, prints its log, and exits with ``strata verify``'s exit code. The Job stays an hour
(``ttlSecondsAfterFinished``) for ``kubectl logs``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any, cast

from strata.config import DEFAULT_PVC_DIR
from strata_operator import api
from strata_operator.admission.mutation import job_id_for
from strata_operator.api import DEFAULT_SIDECAR_IMAGE
from strata_operator.constants import INJECTED_ANNOTATION
from strata_operator.kubectl import EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE, PluginError
from strata_operator.kubectl.cluster import Cluster
from strata_operator.kubectl.status import find_job

VERIFY_LABEL = "strata.dev/verify-job"
CREDENTIALS_DIR = "/var/run/secrets/strata.dev/gcs"


def _label_value(job: str) -> str:
    v = re.sub(r"[^A-Za-z0-9._-]", "-", job)[:63].strip("-._")
    return v or "job"


def _job_pod_spec(cluster: Cluster, ns: str, job: str) -> dict[str, Any]:
    """The spec of one injected pod of ``job`` in ``ns``; ``{}`` when it has none."""
    for pod in cluster.pods(ns):
        meta = pod.get("metadata") or {}
        if INJECTED_ANNOTATION not in (meta.get("annotations") or {}):
            continue
        try:
            if job_id_for(pod, ns) == job:
                return dict(pod.get("spec") or {})
        except ValueError:
            continue
    return {}


def placement_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The ``nodeSelector`` and ``tolerations`` of a training pod's spec (absent keys left out).

    The verify pod takes them so that it can run on the nodes the job runs on: where the claim
    is known to mount and whose taints the job tolerates. Affinity is not copied (a workload's
    pod (anti-)affinity names its own pods' labels, which the verify pod does not carry).
    """
    return {k: pod_spec[k] for k in ("nodeSelector", "tolerations") if pod_spec.get(k)}


def verify_job_manifest(
    policy: dict[str, Any],
    job: str,
    *,
    step: int | None,
    fmt: str,
    image: str | None,
    service_account: str | None,
    placement: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Job object (a dict) verifying ``job``'s durable tiers of ``policy``. Pure.

    ``placement``: ``nodeSelector`` / ``tolerations`` for the pod (:func:`placement_of` of one
    of the job's pods), copied as given.

    Raises :class:`PluginError` when the policy has neither a PVC nor a GCS tier.
    """
    spec = policy.get("spec") or {}
    tiers = spec.get("tiers") or {}
    pvc, gcs = tiers.get("pvc"), tiers.get("gcs")
    if not pvc and not gcs:
        raise PluginError(
            f"policy {policy['metadata']['name']} has only the RAM tier, which lies on each "
            "training node: nothing to verify from a Job (a restore verifies RAM copies)",
            EXIT_USAGE,
        )
    argv = ["strata", "verify"]
    mounts: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = []
    env: list[dict[str, Any]] = []
    if pvc:
        argv.append(f"pvc:{DEFAULT_PVC_DIR}")
        mount: dict[str, Any] = {
            "name": "strata-pvc",
            "mountPath": DEFAULT_PVC_DIR,
            "readOnly": True,
        }
        if pvc.get("subPath"):
            mount["subPath"] = pvc["subPath"]
        mounts.append(mount)
        volumes.append(
            {
                "name": "strata-pvc",
                "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True},
            }
        )
    if gcs:
        argv.append(f"gs://{gcs['bucket']}/{gcs.get('prefix', '')}".rstrip("/"))
        creds = gcs.get("credentials") or {}
        ref = creds.get("secretRef")
        if creds.get("type") == "SecretRef" and ref:
            key = ref.get("key", "key.json")
            volumes.append({"name": "strata-gcs-key", "secret": {"secretName": ref["name"]}})
            mounts.append(
                {"name": "strata-gcs-key", "mountPath": CREDENTIALS_DIR, "readOnly": True}
            )
            env.append(
                {"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": f"{CREDENTIALS_DIR}/{key}"}
            )
    argv += ["--job", job, "--no-progress", "-o", "json" if fmt == "json" else "table"]
    if step is not None:
        argv += ["--step", str(step)]
    container: dict[str, Any] = {
        "name": "verify",
        "image": image or (spec.get("sidecar") or {}).get("image") or DEFAULT_SIDECAR_IMAGE,
        "command": argv,
        "volumeMounts": mounts,
        "env": env,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    for key in ("nodeSelector", "tolerations"):
        if (placement or {}).get(key):
            pod_spec[key] = (placement or {})[key]
    labels = {"app.kubernetes.io/name": "strata-verify", VERIFY_LABEL: _label_value(job)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "generateName": "strata-verify-",
            "namespace": policy["metadata"]["namespace"],
            "labels": labels,
            "annotations": {"strata.dev/verify-job-id": job},
        },
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def _terminated(pod: Any) -> int | None:
    """The verify container's exit code once it terminated, else None."""
    for cs in pod.status.container_statuses or []:
        term = cs.state.terminated if cs.state else None
        if cs.name == "verify" and term is not None:
            return int(term.exit_code)
    if pod.status.phase == "Succeeded":
        return 0
    if pod.status.phase == "Failed":
        return 1
    return None


def verify(cluster: Cluster, args: argparse.Namespace) -> int:
    if args.policy:
        ns = args.namespace or cluster.default_namespace
        policy = cast(
            dict[str, Any],
            cluster.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, ns, api.PLURAL, args.policy
            ),
        )
    else:
        policy, _ = find_job(cluster, args.job, args.namespace, args.all_namespaces)
    ns = policy["metadata"]["namespace"]
    job_pod = _job_pod_spec(cluster, ns, args.job)
    sa = args.service_account or job_pod.get("serviceAccountName") or None
    manifest = verify_job_manifest(
        policy,
        args.job,
        step=args.step,
        fmt=args.output,
        image=args.image,
        service_account=sa,
        placement=placement_of(job_pod),
    )
    created: Any = cluster.batch.create_namespaced_job(ns, cast(Any, manifest))
    name = created.metadata.name
    print(
        f"job.batch/{name} created in {ns}: {' '.join(manifest['spec']['template']['spec']['containers'][0]['command'])}",
        file=sys.stderr,
    )
    if args.no_wait:
        print(name)
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    pod_name = None
    code = None
    waiting = ""
    while time.monotonic() < deadline:
        pods: Any = cluster.core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items
        if pods:
            pod = pods[0]
            pod_name = pod.metadata.name
            code = _terminated(pod)
            if code is not None:
                break
            waiting = "; ".join(
                f"{c.reason}: {c.message}"
                for c in pod.status.conditions or []
                if c.status != "True" and c.message
            )
        time.sleep(1.0)
    if code is None:
        raise PluginError(
            f"job.batch/{name} did not finish in {args.timeout:.0f} s (pod "
            f"{pod_name or 'not created'}{', ' + waiting if waiting else ''}); see "
            f"`kubectl -n {ns} describe job {name}`",
            EXIT_TIMEOUT,
        )
    assert pod_name is not None
    try:
        log = cluster.core.read_namespaced_pod_log(pod_name, ns, container="verify")
        sys.stdout.write(log if log.endswith("\n") or not log else log + "\n")
    except Exception as exc:  # the log is a convenience; the exit code is the result
        print(
            f"(log of pod {pod_name} unavailable: {getattr(exc, 'reason', exc)})", file=sys.stderr
        )
    verdict = "every copy intact" if code == 0 else f"strata verify exited {code}"
    print(f"job.batch/{name}: {verdict}", file=sys.stderr)
    return code
