"""CheckpointPolicies as the operator's own watch last saw them, for the admission webhook.

Why: the webhook needs the policy a pod names. A GET per admission put the apiserver round trip
(and a thread of the default executor, 6 of them on a 2-core node) inside every pod creation: a
1,000-pod JobSet queued its admissions behind those GETs (``make scale`` on a quiet 2-core
machine, before this cache: handler p50 52 ms but p99 4.75 s, close to the webhook's 5 s
timeout). kopf already watches CheckpointPolicies for the reconcile, so the same watch stream
feeds this cache at no extra API cost, the way an informer's lister serves a Kubernetes
controller.

Consistency: the cache is as fresh as the watch (milliseconds behind the apiserver). A policy
the watch has not delivered yet (created a moment ago) is a miss, and the caller falls back to a
GET; a deleted policy is dropped on its DELETED event. Between an update and its event, a pod can
be admitted with the previous version of the policy, as with any informer-backed webhook.

Reads are counted in ``strata_admission_policy_reads_total{source="cache"|"api"}``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter

POLICY_READS = Counter(
    "strata_admission_policy_reads",
    "CheckpointPolicy reads of the admission webhook, by source (cache: the operator's watch; "
    "api: a GET on a cache miss).",
    ["source"],
)


class PolicyCache:
    """CheckpointPolicy objects by (namespace, name), fed by :meth:`policy_event`.

    Values are plain dicts (deep copies of the watch's bodies); callers must not mutate them.
    """

    def __init__(self) -> None:
        self._items: dict[tuple[str, str], dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The policy as last seen, or None (not seen yet, or deleted)."""
        return self._items.get((namespace, name))

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Apply one watch event (``event_type`` None: the initial listing; ``"DELETED"``)."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if not key[1]:
            return
        if event_type == "DELETED":
            self._items.pop(key, None)
            return
        self._items[key] = copy.deepcopy(dict(body))

    async def policy_event(self, body: Mapping[str, Any], type: str | None, **_: Any) -> None:
        """kopf event handler of the CheckpointPolicy watch (registered by the webhook role):
        keeps this cache in step with it."""
        self.observe(type, body)
