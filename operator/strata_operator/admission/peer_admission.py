"""What pod admission does for the peer tier (docs/peers.md) with the API.

:class:`PeerAdmission` (one per webhook, in :class:`strata_operator.admission.webhook.WebhookState`):

- :meth:`PeerAdmission.pod_workload`: the JobSet or Indexed Job of a pod being admitted, read from
  the API by the pod's labels; :mod:`strata_operator.admission.mutation` computes the peer list
  from it (pure).
- :meth:`PeerAdmission.ensure_peer_secret`: the job's peer TLS Secret (``kubernetes.io/tls``,
  built by :func:`strata_operator.admission.peers.peer_secret_data`), created once per job: create,
  and a 409 (already there: another pod of the job, or another operator replica, was first) is
  success. Owned by the CheckpointPolicy (same namespace), so it is garbage-collected with the
  policy.

Both answers are kept briefly and asked once at a time per key
(:class:`strata_operator.admission.single_flight.SingleFlightCache`): without that, every pod of a
burst made a workload GET, generated a CA and a key, and POSTed a Secret that was a 409 for all
pods but the first, two API calls per pod through the default executor; a 512-pod JobSet on a
2-core machine saw handler p99 9.4 s, and about a fifth of its admissions timed out at the
apiserver and were retried. Now a burst of one job makes about one workload GET and one Secret
POST per :data:`WORKLOAD_TTL_SECONDS` / :data:`SECRET_TTL_SECONDS`; past the TTL the answer is
renewed in the background (the admission that finds it old does not wait), in two threads of
its own. What that costs:

- the workload is re-read when the cached one is older than its TTL, has another uid than the one
  the pod names (a workload deleted and created again under the same name), or does not list the
  pod's host name (an Indexed Job whose completions grew); a 404 or an API error is never kept;
- the operator may create Secrets but never reads one (the chart grants ``create`` only), so it
  cannot see a Secret deleted behind its back: the first pod admitted more than
  :data:`SECRET_TTL_SECONDS` after a user deleted the Secret has it created again (in the
  background, moments after its admission); pods admitted before wait in ``ContainerCreating``
  for the mount until then. An operator start (empty
  cache) or a second replica costs one key generation and a 409, nothing more. The key is
  keyed by the policy's uid too, so a policy deleted and created again (its Secrets are garbage
  collected) does not reuse the old answer.

The sidecar itself needs no Kubernetes API permission: the peer list travels in its
``STRATA_CONFIG`` and the kubelet mounts the Secret. Errors: ``kopf.AdmissionError`` naming the
object (403 when the workload does not exist, 503 for an API failure). Requests are counted in
``strata_admission_peer_requests_total{object="workload"|"secret", source="cache"|"api"}``.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import kopf
from prometheus_client import Counter

from strata_operator import api
from strata_operator.admission.peers import (
    PeerSpecError,
    peer_secret_data,
    peer_secret_name,
    workload_peers,
)
from strata_operator.admission.single_flight import SingleFlightCache
from strata_operator.constants import JOB_NAME_LABELS, JOBSET_NAME_LABEL, MANAGED_BY

T = TypeVar("T")

JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
JOB_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")

WORKLOAD_TTL_SECONDS = 5.0
"""How long a pod's JobSet or Job, as read from the API, answers the admissions of its other pods;
seconds. Longer than a burst's spread between two pods, short enough that a change the uid and
host name checks do not catch (module docstring) is seen within seconds."""
SECRET_TTL_SECONDS = 5.0
"""How long "the job's peer Secret exists" is believed without asking; seconds. Bounds how long
pods are admitted against a Secret a user deleted before the next admission creates it again."""
MAX_ENTRIES = 1024
"""Jobs (workloads, Secrets) kept per cache; the least recently used beyond it are dropped."""

PEER_REQUESTS = Counter(
    "strata_admission_peer_requests",
    "Peer tier lookups of the admission webhook, by object (workload: the pod's JobSet or Job; "
    "secret: the job's peer Secret, each api lookup a key generation and a create) and source "
    "(cache: answered by a recent or in-flight request; api: a request to the apiserver).",
    ["object", "source"],
)


def wants_peers(policy: Mapping[str, Any]) -> bool:
    """Whether the CheckpointPolicy object has ``spec.peers``."""
    return (policy.get("spec") or {}).get("peers") is not None


@dataclass(frozen=True)
class CachedWorkload:
    """A workload as the API returned it (``obj``, with ``kind``; read-only), its uid, and the
    host names of its pods (None when it cannot have peers; the mutation says why)."""

    obj: dict[str, Any]
    uid: str | None
    hosts: frozenset[str] | None


def _pod_names_workload(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(kind, name)`` of the workload the pod's labels name (JobSet first), else None."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    jobset = labels.get(JOBSET_NAME_LABEL)
    if jobset:
        return "JobSet", str(jobset)
    job = next((labels[k] for k in JOB_NAME_LABELS if labels.get(k)), None)
    return ("Job", str(job)) if job else None


def _expected_uid(pod: Mapping[str, Any], kind: str) -> str | None:
    """The uid of the workload as the pod states it (JobSet: its uid label; Job: the controller
    owner reference or the controller-uid label), None when the pod does not say."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if kind == "JobSet":
        return labels.get(JOBSET_UID_LABEL) or None
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "Job" and ref.get("controller") and ref.get("uid"):
            return str(ref["uid"])
    return next((str(labels[k]) for k in JOB_UID_LABELS if labels.get(k)), None)


def answers_pod(cached: CachedWorkload, pod: Mapping[str, Any]) -> bool:
    """Whether a workload read earlier can be the pod's: the uid the pod names (if any) is its
    uid, and the pod's host name (if set, as the Job controller sets it for Indexed Jobs) is one
    of its pods' (an Indexed Job whose completions grew since has more pods)."""
    named = _pod_names_workload(pod)
    uid = _expected_uid(pod, named[0]) if named else None
    if uid is not None and cached.uid != uid:
        return False
    hostname = (pod.get("spec") or {}).get("hostname")
    return hostname is None or cached.hosts is None or hostname in cached.hosts


def cached_workload(obj: dict[str, Any]) -> CachedWorkload:
    """``obj`` (a JobSet or Job as the API returns it, with ``kind``) with its uid and its pods'
    host names (None when it cannot have peers)."""
    try:
        hosts: frozenset[str] | None = frozenset(p["id"] for p in workload_peers(obj))
    except PeerSpecError:
        hosts = None
    uid = (obj.get("metadata") or {}).get("uid")
    return CachedWorkload(obj, str(uid) if uid else None, hosts)


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


def create_peer_secret(
    job_id: str, namespace: str, policy: Mapping[str, Any], core_api: Any, timeout: float
) -> bool:
    """Generate the job's key material and create its Secret (blocking: run it in a thread);
    True if created, False on a 409 (it exists). Raises ``kopf.AdmissionError`` (403: the
    operator may not create Secrets; 503: another API error)."""
    from kubernetes.client.exceptions import ApiException

    body = peer_secret_body(job_id, policy)
    try:
        core_api.create_namespaced_secret(namespace, body, _request_timeout=timeout)
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


class PeerAdmission:
    """The API side of peer admission for one webhook, with its two caches (module docstring).

    ``workload_ttl`` / ``secret_ttl``: seconds an answer is reused (0: only admissions running at
    the same time share a request); ``max_entries``: keys kept per cache. Use it from the
    webhook's event loop only.
    """

    def __init__(
        self,
        workload_ttl: float = WORKLOAD_TTL_SECONDS,
        secret_ttl: float = SECRET_TTL_SECONDS,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.workloads: SingleFlightCache[tuple[str, str, str], CachedWorkload] = SingleFlightCache(
            workload_ttl, max_entries, refresh_in_background=True
        )
        self.secrets: SingleFlightCache[tuple[str, str, str], bool] = SingleFlightCache(
            secret_ttl, max_entries, refresh_in_background=True
        )
        # The API requests get their own threads: behind the peer-list builds in the default
        # executor (CPU work, one per pod) a renewal waited seconds in a burst on a busy machine.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="strata-peer-api"
        )

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args)
        )

    async def pod_workload(
        self,
        pod: Mapping[str, Any],
        namespace: str,
        custom_api: Any,
        batch_api: Any,
        timeout: float,
    ) -> dict[str, Any] | None:
        """The pod's JobSet (label ``jobset.sigs.k8s.io/jobset-name``) or Job (job-name labels)
        as a dict with ``kind`` (shared: do not modify it); ``None`` when the pod names neither.
        ``timeout``: seconds per API request."""
        named = _pod_names_workload(pod)
        if named is None:
            return None
        kind, name = named

        def fresh(w: CachedWorkload) -> bool:
            return answers_pod(w, pod)

        async def fetch() -> CachedWorkload:
            PEER_REQUESTS.labels(object="workload", source="api").inc()
            return await self._in_thread(
                _read_cached_workload, kind, name, namespace, custom_api, batch_api, timeout
            )

        cached, fetched = await self.workloads.get_fetched((namespace, kind, name), fetch, fresh)
        if not fetched:
            PEER_REQUESTS.labels(object="workload", source="cache").inc()
        return cached.obj

    async def ensure_peer_secret(
        self,
        job_id: str,
        namespace: str,
        policy: Mapping[str, Any],
        core_api: Any,
        timeout: float,
    ) -> None:
        """Create the job's peer Secret unless it is known to exist (past the TTL: renewed in
        the background, module docstring). Errors: see :func:`create_peer_secret`."""
        uid = str((policy.get("metadata") or {}).get("uid") or "")

        async def create() -> bool:
            PEER_REQUESTS.labels(object="secret", source="api").inc()
            # Key generation is CPU work: off the event loop, with the request.
            return await self._in_thread(
                create_peer_secret, job_id, namespace, policy, core_api, timeout
            )

        key = (namespace, peer_secret_name(job_id), uid)
        _, fetched = await self.secrets.get_fetched(key, create)
        if not fetched:
            PEER_REQUESTS.labels(object="secret", source="cache").inc()


def _read_cached_workload(
    kind: str, name: str, namespace: str, custom_api: Any, batch_api: Any, timeout: float
) -> CachedWorkload:
    return cached_workload(_read_workload(kind, name, namespace, custom_api, batch_api, timeout))


def _read_workload(
    kind: str, name: str, namespace: str, custom_api: Any, batch_api: Any, timeout: float
) -> dict[str, Any]:
    """GET the JobSet or Job (blocking); ``kopf.AdmissionError`` 403 when it does not exist, 503
    for another API error."""
    from kubernetes.client.exceptions import ApiException

    what = f"{kind} {namespace}/{name}"
    try:
        if kind == "JobSet":
            obj: dict[str, Any] = custom_api.get_namespaced_custom_object(
                JOBSET_API[0],
                JOBSET_API[1],
                namespace,
                JOBSET_API[2],
                name,
                _request_timeout=timeout,
            )
        else:
            resp = batch_api.read_namespaced_job(
                name, namespace, _preload_content=False, _request_timeout=timeout
            )
            obj = json.loads(resp.data)
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
    obj.setdefault("kind", kind)
    return obj
