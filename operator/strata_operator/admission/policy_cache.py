"""CheckpointPolicies as the operator's own watch last saw them, for the admission webhook.

Why: the webhook needs the policy a pod names. A GET per admission put the apiserver round trip
(and a thread of the default executor, 6 of them on a 2-core node) inside every pod creation: a
1,000-pod JobSet queued its admissions behind those GETs (``make scale`` on a quiet 2-core
machine, before this cache: handler p50 52 ms but p99 4.75 s, close to the webhook's 5 s
timeout). kopf already watches CheckpointPolicies for the reconcile, so the same watch stream
feeds this cache at no extra API cost, the way an informer's lister serves a Kubernetes
controller.

Consistency: the cache is as fresh as the watch (milliseconds behind the apiserver in steady
state). Right after the operator starts, the watch is not: kopf delivers its initial listing and
the events after it through per-object queues, seconds behind under many policies, so a cache
fed only by it served policies deleted or updated seconds earlier. Hence:

* Before the first admission the webhook LISTs the policies (:meth:`PolicyCache.sync`); the
  cache is *synced* once the watch has delivered, for every listed policy, a version at least as
  new as the listed one (and the DELETED event of every policy it had that the LIST no longer
  has). Until then every admission reads the policy with a GET (:meth:`PolicyCache.synced`), so
  no admission is staler than the apiserver.
* Every entry remembers its ``resourceVersion`` (and a deleted policy its deletion's): an event
  older than what the cache holds (the watch's backlog after the LIST) is ignored, so a backlog
  never brings back a deleted policy or an older spec.

A policy the watch has not delivered yet (created a moment ago) is a miss, and the caller falls
back to a GET. After the sync, between an update and its event a pod can be admitted with the
previous version of the policy, as with any informer-backed webhook (milliseconds).

Reads are counted in ``strata_admission_policy_reads_total{source="cache"|"api"}``.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import Counter

POLICY_READS = Counter(
    "strata_admission_policy_reads",
    "CheckpointPolicy reads of the admission webhook, by source (cache: the operator's watch; "
    "api: a GET on a cache miss).",
    ["source"],
)


Key = tuple[str, str]


def namespace_watched(body: Mapping[str, Any], patterns: tuple[str, ...]) -> bool:
    """Whether the object's namespace matches kopf's ``--namespace`` patterns (globs; ``!glob``
    excludes); every namespace when there are none."""
    namespace = str((body.get("metadata") or {}).get("namespace") or "")
    include = [p for p in patterns if not p.startswith("!")]
    exclude = [p[1:] for p in patterns if p.startswith("!")]
    if include and not any(fnmatch.fnmatchcase(namespace, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(namespace, p) for p in exclude)


def _resource_version(body: Mapping[str, Any]) -> int | None:
    """``metadata.resourceVersion`` as an integer (the apiserver's etcd revision), else None."""
    value = (body.get("metadata") or {}).get("resourceVersion")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _key(body: Mapping[str, Any]) -> Key:
    meta = body.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


class PolicyCache:
    """CheckpointPolicy objects by (namespace, name), fed by :meth:`policy_event` (the watch)
    and checked against one LIST (:meth:`sync`).

    Values are plain dicts (deep copies of the watch's bodies); callers must not mutate them.
    """

    def __init__(self) -> None:
        self._items: dict[Key, dict[str, Any]] = {}
        self._versions: dict[Key, int] = {}
        """Newest resourceVersion seen per key (a deleted policy's: its deletion's)."""
        self._watched: dict[Key, int] = {}
        """Newest resourceVersion the watch delivered per key (-1: its DELETED event)."""
        self._pending: set[Key] | None = None
        """Keys whose listed state the watch has not reached yet; None: not listed yet."""
        self._listed: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    @property
    def listed(self) -> bool:
        """Whether :meth:`sync` has run."""
        return self._pending is not None

    @property
    def synced(self) -> bool:
        """Whether the watch has caught up with the LIST: the cache is then as fresh as the
        watch, and admissions may read it instead of the apiserver."""
        return self._pending is not None and not self._pending

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The policy as last seen, or None (not seen yet, or deleted)."""
        return self._items.get((namespace, name))

    def _newer(self, key: Key, version: int | None) -> bool:
        known = self._versions.get(key)
        return version is None or known is None or version >= known

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Apply one watch event (``event_type`` None: the initial listing; ``"DELETED"``).
        An event older (by resourceVersion) than what the cache holds is ignored."""
        key = _key(body)
        if not key[1]:
            return
        version = _resource_version(body)
        if event_type == "DELETED":
            self._watched[key] = -1
        elif version is not None:
            self._watched[key] = max(version, self._watched.get(key, -1))
        if self._newer(key, version):
            if version is not None:
                self._versions[key] = version
            if event_type == "DELETED":
                self._items.pop(key, None)
            else:
                self._items[key] = copy.deepcopy(dict(body))
        self._settle(key)

    def sync(self, items: Sequence[Mapping[str, Any]], list_version: int | None) -> None:
        """Apply a LIST of every policy (``list_version``: the list's resourceVersion): newer
        listed versions replace the cache's, policies the LIST lacks are dropped, and the cache
        is :attr:`synced` once the watch has caught up with it."""
        listed: dict[Key, int] = {}
        for body in items:
            key = _key(body)
            if not key[1]:
                continue
            version = _resource_version(body)
            listed[key] = version if version is not None else -1
            if self._newer(key, version):
                if version is not None:
                    self._versions[key] = version
                self._items[key] = copy.deepcopy(dict(body))
        for key in [k for k in self._items if k not in listed]:
            known = self._versions.get(key)
            if list_version is None or known is None or known <= list_version:
                self._items.pop(key)
                if list_version is not None:
                    self._versions[key] = list_version
        self._listed = listed
        self._pending = set(listed) | set(self._watched)
        for key in list(self._pending):
            self._settle(key)

    def _settle(self, key: Key) -> None:
        if not self._pending or key not in self._pending:
            return
        watched = self._watched.get(key)
        if key in self._listed:
            done = watched is not None and (watched == -1 or watched >= self._listed[key])
        else:
            # The watch had it, the LIST does not: wait for its DELETED event.
            done = watched is None or watched == -1
        if done:
            self._pending.discard(key)

    async def policy_event(self, body: Mapping[str, Any], type: str | None, **_: Any) -> None:
        """kopf event handler of the CheckpointPolicy watch (registered by the webhook role):
        keeps this cache in step with it."""
        self.observe(type, body)
