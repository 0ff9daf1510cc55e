"""Events against the real apiserver: the operator's recorder writes events.k8s.io/v1 Events that
the apiserver validates, and a repeat is aggregated into the first Event's series (read back
through events.k8s.io/v1, core/v1 and ``kubectl describe``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from e2e.cluster import LocalCluster
from strata_operator.cluster import EventRecorder, EventSpec

pytestmark = pytest.mark.e2e


def config_map(api: ApiClient, namespace: str) -> dict[str, Any]:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "regarded"}}
    core: Any = client.CoreV1Api(api)  # dict bodies and raw responses, as in the operator
    raw = core.create_namespaced_config_map(namespace, body, _preload_content=False)
    obj: dict[str, Any] = json.loads(raw.data)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}


def core_events(api: ApiClient, namespace: str) -> list[dict[str, Any]]:
    core: Any = client.CoreV1Api(api)
    raw = core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=regarded", _preload_content=False
    )
    return list(json.loads(raw.data)["items"])


def test_a_repeated_event_is_one_event_whose_series_counts_the_repeats(
    api: ApiClient, k8s_cluster: LocalCluster, k8s_namespace: str
) -> None:
    obj = config_map(api, k8s_namespace)
    recorder = EventRecorder(api, action="Reconcile")
    pending = EventSpec("Warning", "PVCPending", "claim ckpt is Pending; create it")
    for _ in range(3):
        recorder.post(obj, pending)
    recorder.post(obj, EventSpec("Normal", "Ready", "claim ckpt is Bound"))

    events = core_events(api, k8s_namespace)
    assert sorted(e["reason"] for e in events) == ["PVCPending", "Ready"]
    (repeated,) = [e for e in events if e["reason"] == "PVCPending"]
    # core/v1 shows the series too (kubectl describe: "(x3 over ...)"); the deprecated count,
    # firstTimestamp, lastTimestamp and source stay unset, as events.k8s.io/v1 requires.
    assert repeated["series"]["count"] == 3
    assert repeated["message"] == pending.message
    assert repeated["involvedObject"]["uid"] == obj["metadata"]["uid"]
    assert repeated["reportingComponent"] == "strata-operator"
    events_api: Any = client.EventsV1Api(api)
    raw = events_api.read_namespaced_event(
        repeated["metadata"]["name"], k8s_namespace, _preload_content=False
    )
    v1 = json.loads(raw.data)
    assert v1["series"]["count"] == 3 and v1["action"] == "Reconcile"
    assert v1["regarding"]["name"] == "regarded"
    described = k8s_cluster.kubectl("describe", "configmap", "regarded", "-n", k8s_namespace)
    assert "(x3 over" in described and "strata-operator" in described  # Age, From


def test_an_event_deleted_by_the_apiserver_is_posted_anew(
    api: ApiClient, k8s_namespace: str
) -> None:
    obj = config_map(api, k8s_namespace)
    recorder = EventRecorder(api, action="Reconcile")
    spec = EventSpec("Normal", "Restored", "restored step 100 from pvc")
    recorder.post(obj, spec)
    recorder.post(obj, spec)
    (first,) = core_events(api, k8s_namespace)
    client.CoreV1Api(api).delete_namespaced_event(first["metadata"]["name"], k8s_namespace)
    recorder.post(obj, spec)
    (second,) = core_events(api, k8s_namespace)
    assert second["metadata"]["name"] != first["metadata"]["name"]
    assert second.get("series") is None
