"""What pod admission does for the peer tier (docs/peers.md) with the API.

- :func:`pod_workload`: the JobSet or Indexed Job of a pod being admitted, read from the API by the
  pod's labels; :mod:`strata_operator.admission.mutation` computes the peer list from it (pure).
- :func:`ensure_peer_secret`: the job's peer TLS Secret (``kubernetes.io/tls``, built by
  :func:`strata_operator.admission.peers.peer_secret_data`), created once per job: create, and a 409
  (already there: another pod of the job was admitted first) is success. Owned by the
  CheckpointPolicy (same namespace), so it is garbage-collected with the policy.

The sidecar itself needs no Kubernetes API permission: the peer list travels in its
``STRATA_CONFIG`` and the kubelet mounts the Secret. Errors: ``kopf.AdmissionError`` naming the
object (403 when the workload does not exist, 503 for an API failure).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping
from typing import Any

import kopf

from strata_operator import api
from strata_operator.admission.peers import peer_secret_data, peer_secret_name
from strata_operator.constants import JOB_NAME_LABELS, JOBSET_NAME_LABEL, MANAGED_BY

JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


def wants_peers(policy: Mapping[str, Any]) -> bool:
    """Whether the CheckpointPolicy object has ``spec.peers``."""
    return (policy.get("spec") or {}).get("peers") is not None


async def pod_workload(
    pod: Mapping[str, Any], namespace: str, custom_api: Any, batch_api: Any, timeout: float
) -> dict[str, Any] | None:
    """The pod's JobSet (label ``jobset.sigs.k8s.io/jobset-name``) or Job (job-name labels) as
    a dict with ``kind``; ``None`` when the pod names neither."""
    from kubernetes.client.exceptions import ApiException

    labels = (pod.get("metadata") or {}).get("labels") or {}
    jobset = labels.get(JOBSET_NAME_LABEL)
    job = next((labels[k] for k in JOB_NAME_LABELS if labels.get(k)), None)
    try:
        if jobset:
            what = f"JobSet {namespace}/{jobset}"
            obj: dict[str, Any] = await asyncio.to_thread(
                custom_api.get_namespaced_custom_object,
                JOBSET_API[0],
                JOBSET_API[1],
                namespace,
                JOBSET_API[2],
                jobset,
                _request_timeout=timeout,
            )
            obj.setdefault("kind", "JobSet")
            return obj
        if job:
            what = f"Job {namespace}/{job}"
            resp = await asyncio.to_thread(
                batch_api.read_namespaced_job,
                job,
                namespace,
                _preload_content=False,
                _request_timeout=timeout,
            )
            obj = json.loads(resp.data)
            obj.setdefault("kind", "Job")
            return obj
    except ApiException as exc:
        if exc.status == 404:
            raise kopf.AdmissionError(
                f"{what} (named by the pod's labels) not found; the peer tier computes the peer "
                "list from it",
                code=403,
            ) from None
        raise kopf.AdmissionError(
            f"cannot read {what}: API error {exc.status} {exc.reason}", code=503
        ) from None
    return None


def peer_secret_body(job_id: str, policy: Mapping[str, Any]) -> dict[str, Any]:
    """The Secret object (owner: the policy) for ``job_id``; fresh key material each call."""
    meta = policy.get("metadata") or {}
    data = {k: base64.b64encode(v).decode("ascii") for k, v in peer_secret_data(job_id).items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": peer_secret_name(job_id),
            "namespace": meta.get("namespace"),
            "labels": dict(MANAGED_BY),
            "annotations": {"strata.dev/job-id": job_id},
            "ownerReferences": [
                {
                    "apiVersion": f"{api.GROUP}/{api.VERSION}",
                    "kind": api.KIND,
                    "name": meta.get("name"),
                    "uid": meta.get("uid"),
                }
            ],
        },
        "data": data,
    }


async def ensure_peer_secret(
    job_id: str, namespace: str, policy: Mapping[str, Any], core_api: Any, timeout: float
) -> bool:
    """Create the job's peer Secret unless it exists; True if this call created it."""
    from kubernetes.client.exceptions import ApiException

    body = peer_secret_body(job_id, policy)
    try:
        await asyncio.to_thread(
            core_api.create_namespaced_secret, namespace, body, _request_timeout=timeout
        )
    except ApiException as exc:
        if exc.status == 409:
            return False
        if exc.status == 403:
            raise kopf.AdmissionError(
                f"Strata: the operator may not create the peer TLS Secret "
                f"{namespace}/{body['metadata']['name']} of job {job_id} (policies with "
                "spec.peers need it): install the chart with operator.peerSecrets=true, or "
                "remove spec.peers from the policy",
                code=403,
            ) from None
        raise kopf.AdmissionError(
            f"Strata: cannot create the peer TLS Secret {namespace}/{body['metadata']['name']} of job "
            f"{job_id}: API error {exc.status} {exc.reason}; the operator needs 'create secrets'",
            code=503,
        ) from None
    return True
