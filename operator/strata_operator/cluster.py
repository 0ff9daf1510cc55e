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

Events are posted with :func:`post_event` after the status patch they accompany succeeded (the
JobSet way); a failure to post one is logged, never raised: an Event is advice, not state.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from strata.errors import StrataError
from strata_operator import api
from strata_operator.api import conditions as c
from strata_operator.api.events import EventSpec
from strata_operator.constants import COMPONENT, FIELD_MANAGER

__all__ = ["ClusterWriteFailed", "EventSpec", "StatusWriter", "get_policy", "post_event"]

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


def post_event(
    core_api: Any, obj: Mapping[str, Any], event: EventSpec, *, now: datetime | None = None
) -> None:
    """Create a core/v1 Event about ``obj`` (kubectl describe lists it); errors are logged only.

    ``core_api``: a ``kubernetes.client.CoreV1Api``; ``obj``: the involved object as a dict
    (``apiVersion``, ``kind``, ``metadata`` with name, namespace, uid).
    """
    from kubernetes.client.exceptions import ApiException

    meta = obj.get("metadata") or {}
    stamp = c.format_time(now or datetime.now(UTC))
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "generateName": f"{meta.get('name', 'strata')[:200]}.",
            "namespace": meta.get("namespace"),
        },
        "involvedObject": {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": event.reason,
        "message": event.message[:1024],
        "type": event.type,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        core_api.create_namespaced_event(meta.get("namespace"), body, _request_timeout=10)
    except (ApiException, OSError) as exc:
        log.warning("could not post event %s on %s: %s", event.reason, meta.get("name"), exc)
