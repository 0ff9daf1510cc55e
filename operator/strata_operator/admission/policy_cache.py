"""CheckpointPolicies as the operator's own watch last saw them, for the admission webhook.

Why: the webhook needs the policy a pod names. A GET per admission put the apiserver round trip
(and a thread of the default executor, 6 of them on a 2-core node) inside every pod creation: a
1,000-pod JobSet queued its admissions behind those GETs (``make scale`` on a quiet 2-core
machine, before this cache: handler p50 52 ms but p99 4.75 s, close to the webhook's 5 s
timeout). kopf already watches CheckpointPolicies for the reconcile, so the same watch stream
feeds this cache at no extra API cost, the way an informer's lister serves a Kubernetes
controller.

Consistency: kopf delivers its watch through per-object queues that, right after the operator
starts and under many policies, run seconds behind (they also carry each policy's reconcile): a
cache fed only by kopf served policies deleted or updated seconds earlier. So the webhook keeps the
cache with its own LIST + WATCH (:class:`PolicyWatch`, a thread; milliseconds behind the
apiserver), and:

* until its first LIST is in the cache, and whenever that watch is broken, the cache is not
  :attr:`PolicyCache.synced` and every admission reads the policy with a GET (the first
  admission after a start waits briefly for the LIST);
* every entry remembers its ``resourceVersion`` (a deleted policy: its deletion's), and an event
  older than what the cache holds (kopf's backlog) is ignored, so no queue brings back a deleted
  policy or an older spec.

A policy the watch has not delivered yet (created a moment ago) is a miss, and the caller falls
back to a GET. After the sync, between an update and its event a pod can be admitted with the
previous version of the policy, as with any informer-backed webhook (milliseconds).

Reads are counted in ``strata_admission_policy_reads_total{source="cache"|"api"}``.
"""

from __future__ import annotations

import asyncio
import copy
import fnmatch
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import Counter, Gauge

log = logging.getLogger("strata.webhook")

CACHE_VERSION = Gauge(
    "strata_admission_policy_cache_resource_version",
    "Newest CheckpointPolicy resourceVersion the admission webhook's cache has applied (etcd "
    "revision; every change up to it is in the cache).",
)

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
    """CheckpointPolicy objects by (namespace, name), fed by :meth:`sync` (a LIST) and
    :meth:`observe` (watch events: the webhook's own watch, and kopf's through
    :meth:`policy_event`).

    Values are plain dicts (deep copies of the bodies); callers must not mutate them.
    Thread-safe: the webhook's watch thread applies its events at once, not through the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Key, dict[str, Any]] = {}
        self._versions: dict[Key, int] = {}
        """Newest resourceVersion seen per key (a deleted policy's: its deletion's)."""
        self._synced = False
        self._newest = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def synced(self) -> bool:
        """Whether the cache holds a LIST and every event of the watch since: only then may an
        admission read it instead of the apiserver."""
        return self._synced

    def mark_unsynced(self) -> None:
        """The watch that keeps the cache current is broken (until the next :meth:`sync`)."""
        with self._lock:
            self._synced = False

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The policy as last seen, or None (not seen yet, or deleted)."""
        with self._lock:
            return self._items.get((namespace, name))

    def get_synced(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(:attr:`synced`, :meth:`get`) read together."""
        with self._lock:
            return self._synced, self._items.get((namespace, name))

    def _newer(self, key: Key, version: int | None) -> bool:
        known = self._versions.get(key)
        return version is None or known is None or version >= known

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Apply one watch event (``event_type`` None: kopf's initial listing; ``"DELETED"``).
        An event older (by resourceVersion) than what the cache holds is ignored."""
        key = _key(body)
        if not key[1]:
            return
        version = _resource_version(body)
        value = None if event_type == "DELETED" else copy.deepcopy(dict(body))
        with self._lock:
            if not self._newer(key, version):
                return
            if version is not None:
                self._versions[key] = version
                self._applied(version)
            if value is None:
                self._items.pop(key, None)
            else:
                self._items[key] = value

    def sync(self, items: Sequence[Mapping[str, Any]], list_version: int | None) -> None:
        """Apply a LIST of every policy (``list_version``: the list's resourceVersion): newer
        listed versions replace the cache's, policies the LIST lacks are dropped (unless seen in
        a newer version since), and the cache is :attr:`synced`."""
        with self._lock:
            self._sync(items, list_version)

    def _applied(self, version: int) -> None:
        if version > self._newest:
            self._newest = version
            CACHE_VERSION.set(version)

    def _sync(self, items: Sequence[Mapping[str, Any]], list_version: int | None) -> None:
        listed: set[Key] = set()
        for body in items:
            key = _key(body)
            if not key[1]:
                continue
            listed.add(key)
            version = _resource_version(body)
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
        if list_version is not None:
            self._applied(list_version)
        self._synced = True

    async def policy_event(self, body: Mapping[str, Any], type: str | None, **_: Any) -> None:
        """kopf event handler of the CheckpointPolicy watch (registered by the webhook role).
        kopf delivers through per-object queues, seconds behind after a start, so the cache is
        synced by the webhook's own watch (:class:`PolicyWatch`); these events only ever
        replace older versions."""
        self.observe(type, body)


class PolicyWatch:
    """The webhook's own LIST + WATCH of CheckpointPolicies, in a daemon thread, feeding a
    :class:`PolicyCache` from that thread (milliseconds behind the apiserver, whatever kopf's
    queues or the event loop hold; ``loop`` only hears of the first LIST). ``custom_api``: a ``kubernetes.client.CustomObjectsApi``;
    ``namespaces``: kopf's ``--namespace`` patterns (empty: all).

    While the watch is broken (an API error, a 410 Gone) the cache is not :attr:`synced`, and
    admissions read the apiserver; it LISTs again after ``retry_seconds``.
    """

    def __init__(
        self,
        cache: PolicyCache,
        custom_api: Any,
        loop: asyncio.AbstractEventLoop,
        namespaces: tuple[str, ...] = (),
        retry_seconds: float = 2.0,
    ) -> None:
        self.cache, self.custom_api, self.loop = cache, custom_api, loop
        self.namespaces = namespaces
        self.retry_seconds = retry_seconds
        self.listed = asyncio.Event()
        """Set (on the loop) after the first LIST is in the cache."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="strata-policy-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        from strata_operator.cluster import list_policies, watch_policies

        while not self._stop.is_set():
            try:
                items, version = list_policies(self.custom_api)
                items = [i for i in items if namespace_watched(i, self.namespaces)]
                self.cache.sync(items, version)
                self._call(self.listed.set)
                log.info("policy cache listed %d CheckpointPolicies", len(items))
                for event_type, body in watch_policies(self.custom_api, version, self._stop):
                    if namespace_watched(body, self.namespaces):
                        self.cache.observe(event_type, body)
            except Exception as exc:
                log.warning(
                    "the policy watch broke (%s: %s); admissions read the apiserver until it is "
                    "back",
                    type(exc).__name__,
                    exc,
                )
            self.cache.mark_unsynced()
            self._stop.wait(self.retry_seconds)
