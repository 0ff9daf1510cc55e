"""The operator's reads and writes of its own objects: CheckpointPolicies, their status, Events.

Rule: the one module that patches a CheckpointPolicy's status or posts an Event; the roles
(reconcile, reports, admission) decide *what* to write and call this module to write it. It
imports the API's names and nothing above them; the Kubernetes client objects it is given are
the caller's (``kubernetes.client.CoreV1Api`` and ``CustomObjectsApi``).

The status has two writers with disjoint fields, both merge patches of the status subresource
under one field manager (:data:`strata_operator.constants.FIELD_MANAGER`):

* :meth:`StatusWriter.write_conditions`: ``observedGeneration`` and ``conditions``, written by
  the reconcile. Unguarded: nobody else writes those fields, and the reconcile decides from the
  spec, not from the status it read.
* :meth:`StatusWriter.write_jobs`: ``jobs`` and ``newestCompleteStep``, written by the report
  receiver. Guarded by ``resourceVersion``: the receiver folds reports into the ``jobs`` it read,
  so a concurrent write must make it re-read and fold again. The same patch carries the whole
  ``conditions`` list when the receiver's one condition, ``FlushFitsGracePeriod`` (from the
  sidecars' flush estimates), changed; the reconcile keeps condition types it does not own, and
  a reconcile write that raced it away is repaired by the next report.

Events are posted with :class:`EventRecorder` after the status patch they accompany succeeded (the
JobSet way); a failure to post one is logged, never raised: an Event is advice, not state. They are
events.k8s.io/v1 Events, and a repeated one (same object, type, reason, action, message) is
aggregated into its first Event's ``series`` (count, last observed time) instead of being posted
again; :class:`EventRecorder` says why this is not kopf's or another library's recorder.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from strata.errors import StrataError
from strata_operator import api
from strata_operator.api.events import EventSpec
from strata_operator.constants import COMPONENT, FIELD_MANAGER

__all__ = ["ClusterWriteFailed", "EventRecorder", "EventSpec", "StatusWriter", "get_policy"]

log = logging.getLogger("strata.operator.cluster")

REQUEST_TIMEOUT = 30.0
"""Seconds a status patch or a policy read may take (connect + response)."""


class ClusterWriteFailed(StrataError):
    """The apiserver refused or did not answer a status write; ``status`` is the HTTP status
    (None: no answer). Retry later: the message says which object and why."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def get_policy(
    custom_api: Any, namespace: str, name: str, *, timeout: float = REQUEST_TIMEOUT
) -> dict[str, Any] | None:
    """The CheckpointPolicy object as the apiserver holds it; None when it does not exist.

    Errors: ``kubernetes.client.exceptions.ApiException`` for any other API failure.
    """
    from kubernetes.client.exceptions import ApiException

    try:
        obj: dict[str, Any] = custom_api.get_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, _request_timeout=timeout
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return obj


def list_policies(
    custom_api: Any, *, timeout: float = REQUEST_TIMEOUT
) -> tuple[list[dict[str, Any]], int | None]:
    """Every CheckpointPolicy in the cluster and the list's resourceVersion (an integer, None
    when the apiserver gives none that is one), read in one LIST from the apiserver.

    Errors: ``kubernetes.client.exceptions.ApiException`` for an API failure.
    """
    resp = custom_api.list_cluster_custom_object(
        api.GROUP, api.VERSION, api.PLURAL, _preload_content=False, _request_timeout=timeout
    )
    data: dict[str, Any] = json.loads(resp.data)
    version = (data.get("metadata") or {}).get("resourceVersion")
    try:
        list_version = int(version) if version is not None else None
    except ValueError:
        list_version = None
    return list(data.get("items") or []), list_version


WATCH_SECONDS = 240
"""Server-side timeout of one policy WATCH request; it is renewed from the last version seen."""


def watch_policies(
    custom_api: Any, resource_version: int | None, stop: threading.Event
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(type, object)`` of every CheckpointPolicy change after ``resource_version``
    (``ADDED``, ``MODIFIED``, ``DELETED``), until ``stop`` is set; renews the WATCH request from
    the last version seen. Bookmarks are consumed here.

    Errors: ``kubernetes.client.exceptions.ApiException`` (410 when the version is too old: LIST
    again) and connection errors.
    """
    from kubernetes import watch
    from kubernetes.client.exceptions import ApiException

    version = None if resource_version is None else str(resource_version)
    while not stop.is_set():
        w = watch.Watch()  # type: ignore[no-untyped-call]
        kwargs: dict[str, Any] = {"timeout_seconds": WATCH_SECONDS, "allow_watch_bookmarks": True}
        if version is not None:
            kwargs["resource_version"] = version
        for event in w.stream(  # type: ignore[no-untyped-call]
            custom_api.list_cluster_custom_object, api.GROUP, api.VERSION, api.PLURAL, **kwargs
        ):
            if stop.is_set():
                w.stop()  # type: ignore[no-untyped-call]
                return
            kind, obj = event.get("type"), event.get("object")
            if kind == "ERROR":
                code = obj.get("code") if isinstance(obj, dict) else None
                raise ApiException(status=code or 500, reason=str(obj))
            if not isinstance(obj, dict):
                continue
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                yield str(kind), obj


class StatusWriter:
    """The one writer of ``CheckpointPolicy.status`` (see the module docstring for who owns which
    fields). ``custom_api``: a ``kubernetes.client.CustomObjectsApi``."""

    def __init__(self, custom_api: Any, *, timeout: float = REQUEST_TIMEOUT) -> None:
        self._custom = custom_api
        self._timeout = timeout

    def write_conditions(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Merge-patch ``observedGeneration``/``conditions``; False when the policy is gone.

        Errors: :class:`ClusterWriteFailed` on any other API failure or no answer.
        """
        return self._patch(namespace, name, {"status": dict(status)}, gone_ok=True)

    def write_jobs(
        self, namespace: str, name: str, resource_version: str, status: Mapping[str, Any]
    ) -> bool:
        """Merge-patch ``jobs``/``newestCompleteStep`` (and ``conditions``) if the policy is still at
        ``resource_version``; False on a conflict (409: re-read, fold again, retry).

        Errors: :class:`ClusterWriteFailed` on any other API failure (a deleted policy included).
        """
        body = {"metadata": {"resourceVersion": resource_version}, "status": dict(status)}
        return self._patch(namespace, name, body, gone_ok=False)

    def _patch(self, namespace: str, name: str, body: dict[str, Any], *, gone_ok: bool) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            self._custom.patch_namespaced_custom_object_status(
                api.GROUP,
                api.VERSION,
                namespace,
                api.PLURAL,
                name,
                body,
                field_manager=FIELD_MANAGER,
                _content_type="application/merge-patch+json",
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            if exc.status == 404 and gone_ok:
                return False
            if exc.status == 409 and not gone_ok:
                return False
            raise ClusterWriteFailed(
                f"status patch of CheckpointPolicy {namespace}/{name} failed: "
                f"{exc.status} {exc.reason}",
                status=exc.status,
            ) from None
        except OSError as exc:
            raise ClusterWriteFailed(
                f"status patch of CheckpointPolicy {namespace}/{name} failed: {exc}"
            ) from None
        return True


EVENT_NOTE_BYTES = 1024
"""Longest ``note`` (message) of an events.k8s.io/v1 Event, in bytes (apiserver validation)."""
EVENT_SERIES_CACHE = 4096
"""Event series remembered (least recently seen dropped first); a forgotten one starts anew."""

_EventKey = tuple[str, ...]


@dataclass
class _Series:
    name: str
    namespace: str
    count: int
    lock: threading.Lock = field(default_factory=threading.Lock)


class EventRecorder:
    """Posts events.k8s.io/v1 Events about objects, aggregating repeats into a series.

    The first occurrence of an Event (same object, type, reason, action and message) creates one;
    each repeat PATCHes that Event's ``series`` (``count`` 2, 3, ... and ``lastObservedTime``), so
    ``kubectl describe`` shows ``(x3 over 10m)`` and the namespace holds one Event instead of one
    per occurrence. These are the semantics of client-go's events.k8s.io recorder
    (``k8s.io/client-go/tools/events``), except that every repeat is written at once rather than on
    a 30-minute heartbeat: the operator's Events are state changes, not a stream. A series lasts
    as long as this process remembers it (:data:`EVENT_SERIES_CACHE`) and the apiserver keeps the
    Event (``--event-ttl``, 1 h by default): when the PATCH finds it gone, that occurrence creates
    a new Event.

    Why not a library's recorder: ``kopf.event`` creates a new core/v1 Event per call (kopf's
    ``post_event`` says aggregation "should be done by the client library") and is made for kopf's
    handlers (it queues into the operator's context), while the report receiver posts from its own
    HTTP server; the Kubernetes Python client has no recorder, so its ``EventsV1Api`` does the
    writes here. Read through core/v1, these Events carry ``series`` but no ``count``,
    ``firstTimestamp``, ``lastTimestamp`` or ``source`` (events.k8s.io/v1 refuses those on create);
    ``kubectl describe`` shows the series ("x3 over 10m") and ``reportingController`` as "From".

    ``api_client``: a ``kubernetes.client.ApiClient`` (None: the default one); ``events_api``: the
    ``kubernetes.client.EventsV1Api`` to write with (None: one on ``api_client``). ``action``: the
    ``action`` of Events whose :class:`EventSpec` gives none (``Reconcile``); ``instance``: the
    ``reportingInstance`` (None: ``strata-operator-<hostname>``, the pod's name in a pod). Errors
    are logged, never raised: an Event is advice, not state. Thread-safe.
    """

    def __init__(
        self,
        api_client: Any = None,
        *,
        action: str,
        events_api: Any = None,
        instance: str | None = None,
        timeout: float = 10.0,
        cache_size: int = EVENT_SERIES_CACHE,
    ) -> None:
        from kubernetes import client

        # Bodies are dicts, as in the other writers here.
        self._api: Any = events_api or client.EventsV1Api(api_client)
        self._action = action
        self._instance = (instance or f"{COMPONENT}-{socket.gethostname()}")[:128]
        self._timeout = timeout
        self._cache_size = cache_size
        self._series: OrderedDict[_EventKey, _Series] = OrderedDict()
        self._lock = threading.Lock()

    def post(
        self, obj: Mapping[str, Any], event: EventSpec, *, now: datetime | None = None
    ) -> None:
        """Record ``event`` about ``obj`` (a dict with ``apiVersion``, ``kind``, ``metadata`` with
        name, namespace, uid): a new Event, or one more in the series of an equal one."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        meta = obj.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        note = event.message.encode()[:EVENT_NOTE_BYTES].decode(errors="ignore")
        action = event.action or self._action
        key: _EventKey = (
            str(obj.get("apiVersion")),
            str(obj.get("kind")),
            namespace,
            str(meta.get("name")),
            str(meta.get("uid")),
            event.type,
            event.reason,
            action,
            note,
        )
        stamp = _micro_time(now or datetime.now(UTC))
        series = self._remember(key)
        try:
            with series.lock:
                if series.name and self._add_to_series(series, stamp):
                    return
                body = {
                    "apiVersion": "events.k8s.io/v1",
                    "kind": "Event",
                    "metadata": {"name": _event_name(meta, now), "namespace": namespace},
                    "eventTime": stamp,
                    "reportingController": COMPONENT,
                    "reportingInstance": self._instance,
                    "action": action[:128],
                    "reason": event.reason[:128],
                    "type": event.type,
                    "note": note,
                    "regarding": {
                        "apiVersion": obj.get("apiVersion"),
                        "kind": obj.get("kind"),
                        "name": meta.get("name"),
                        "namespace": namespace,
                        "uid": meta.get("uid"),
                        "resourceVersion": meta.get("resourceVersion"),
                    },
                }
                resp = self._api.create_namespaced_event(
                    namespace,
                    body,
                    field_manager=FIELD_MANAGER,
                    _preload_content=False,
                    _request_timeout=self._timeout,
                )
                created = json.loads(resp.data)
                series.name = str(created["metadata"]["name"])
                series.namespace = namespace
                series.count = 1
        except (ApiException, OSError, HTTPError, ValueError, KeyError) as exc:
            log.warning("could not post event %s on %s: %s", event.reason, meta.get("name"), exc)

    def _remember(self, key: _EventKey) -> _Series:
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(name="", namespace="", count=0)
            self._series.move_to_end(key)
            while len(self._series) > self._cache_size:
                self._series.popitem(last=False)
            return series

    def _add_to_series(self, series: _Series, stamp: str) -> bool:
        """PATCH one more occurrence into the series' Event; False when the Event is gone."""
        from kubernetes.client.exceptions import ApiException

        count = series.count + 1
        try:
            self._api.patch_namespaced_event(
                series.name,
                series.namespace,
                {"series": {"count": count, "lastObservedTime": stamp}},
                field_manager=FIELD_MANAGER,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            if exc.status == 404:  # expired (--event-ttl) or deleted: start a new Event
                series.name = ""
                return False
            raise
        series.count = count
        return True


def _event_name(meta: Mapping[str, Any], now: datetime | None) -> str:
    """``<object name>.<hex nanoseconds><hex random>``: client-go's Event name, and a DNS subdomain
    as events.k8s.io/v1 requires (it refuses a ``generateName`` ending in ``.``)."""
    when = (now or datetime.now(UTC)).timestamp()
    return f"{str(meta.get('name') or 'strata')[:200]}.{int(when * 1e9):x}{secrets.token_hex(2)}"


def _micro_time(when: datetime) -> str:
    """A ``metav1.MicroTime``: RFC 3339 in UTC with microseconds."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
