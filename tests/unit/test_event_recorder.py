"""Events: a repeat (same object, type, reason, action, message) joins the first Event's series
instead of becoming a new Event (issue 30 item 6); against a fake events.k8s.io/v1 API."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from strata_operator.api.validation import DNS_SUBDOMAIN_PATTERN
from strata_operator.cluster import EVENT_NOTE_BYTES, EventRecorder, EventSpec

pytestmark = pytest.mark.unit

POLICY: dict[str, Any] = {
    "apiVersion": "strata.dev/v1alpha1",
    "kind": "CheckpointPolicy",
    "metadata": {"name": "fast", "namespace": "team-a", "uid": "u-1", "resourceVersion": "7"},
}
T0 = datetime(2026, 12, 3, 11, 0, tzinfo=UTC)


class FakeEventsApi:
    """Records creates and merge patches; ``gone`` names Events a PATCH finds deleted (404)."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.gone: set[str] = set()
        self.fail: ApiException | None = None

    def create_namespaced_event(self, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        self.calls.append("create")
        if self.fail is not None:
            raise self.fail
        assert kw["_preload_content"] is False and kw["_request_timeout"] > 0
        name = body["metadata"]["name"]
        assert re.fullmatch(DNS_SUBDOMAIN_PATTERN, name) and name not in self.events
        self.events[name] = json.loads(json.dumps(body)) | {"metadata": {"name": name}}
        return SimpleNamespace(data=json.dumps({"metadata": {"name": name}}).encode())

    def patch_namespaced_event(
        self, name: str, namespace: str, body: dict[str, Any], **kw: Any
    ) -> None:
        self.calls.append("patch")
        assert kw["_content_type"] == "application/merge-patch+json"
        if name in self.gone:
            raise ApiException(status=404, reason="Not Found")
        self.events[name].update(body)


def recorder() -> tuple[EventRecorder, FakeEventsApi]:
    fake = FakeEventsApi()
    return EventRecorder(events_api=fake, action="Reconcile", instance="op-0"), fake


def test_the_first_event_is_created_with_what_events_k8s_io_v1_requires() -> None:
    rec, fake = recorder()
    rec.post(POLICY, EventSpec("Warning", "PVCPending", "claim ckpt is Pending"), now=T0)
    (event,) = fake.events.values()
    assert event["eventTime"] == "2026-12-03T11:00:00.000000Z"
    assert (event["reportingController"], event["reportingInstance"]) == ("strata-operator", "op-0")
    assert (event["type"], event["reason"], event["action"]) == (
        "Warning",
        "PVCPending",
        "Reconcile",
    )
    assert event["note"] == "claim ckpt is Pending"
    assert event["regarding"]["uid"] == "u-1" and event["regarding"]["namespace"] == "team-a"
    assert "series" not in event


def test_a_repeated_event_increments_the_series_of_the_first_instead_of_a_new_event() -> None:
    rec, fake = recorder()
    spec = EventSpec("Warning", "PVCPending", "claim ckpt is Pending")
    for i in range(3):
        moved = {**POLICY, "metadata": {**POLICY["metadata"], "resourceVersion": str(8 + i)}}
        rec.post(moved, spec, now=T0 + timedelta(minutes=i))
    (event,) = fake.events.values()
    assert event["series"] == {"count": 3, "lastObservedTime": "2026-12-03T11:02:00.000000Z"}
    assert fake.calls == ["create", "patch", "patch"]


def test_a_different_message_reason_object_or_action_is_its_own_event() -> None:
    rec, fake = recorder()
    rec.post(POLICY, EventSpec("Warning", "PVCPending", "claim a is Pending"))
    rec.post(POLICY, EventSpec("Warning", "PVCPending", "claim b is Pending"))
    rec.post(POLICY, EventSpec("Normal", "Ready", "claim a is Pending"))
    rec.post(POLICY, EventSpec("Warning", "PVCPending", "claim a is Pending", action="CheckPod"))
    other = {**POLICY, "metadata": {**POLICY["metadata"], "name": "slow", "uid": "u-2"}}
    rec.post(other, EventSpec("Warning", "PVCPending", "claim a is Pending"))
    assert fake.calls == ["create"] * 5 and len(fake.events) == 5


def test_an_event_the_apiserver_dropped_starts_a_new_series() -> None:
    rec, fake = recorder()
    spec = EventSpec("Normal", "Restored", "restored step 100")
    rec.post(POLICY, spec)
    rec.post(POLICY, spec)
    fake.gone = set(fake.events)  # --event-ttl passed
    rec.post(POLICY, spec)
    assert fake.calls == ["create", "patch", "patch", "create"]
    newest = list(fake.events.values())[-1]
    assert "series" not in newest


def test_a_failed_post_is_logged_not_raised_and_the_next_one_creates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec, fake = recorder()
    fake.fail = ApiException(status=403, reason="Forbidden")
    spec = EventSpec("Warning", "TierFailed", "pvc: disk full")
    rec.post(POLICY, spec)
    assert "could not post event TierFailed on fast" in caplog.text
    fake.fail = None
    rec.post(POLICY, spec)
    assert fake.calls == ["create", "create"] and len(fake.events) == 1


def test_a_long_message_is_cut_to_the_note_limit_in_bytes() -> None:
    rec, fake = recorder()
    rec.post(POLICY, EventSpec("Warning", "TierFailed", "é" * 2000))
    (event,) = fake.events.values()
    assert len(event["note"].encode()) <= EVENT_NOTE_BYTES
    assert event["note"] == "é" * (EVENT_NOTE_BYTES // 2)


def test_the_series_cache_is_bounded() -> None:
    fake = FakeEventsApi()
    rec = EventRecorder(events_api=fake, action="Reconcile", instance="op-0", cache_size=2)
    for message in ("a", "b", "c", "a"):
        rec.post(POLICY, EventSpec("Normal", "Ready", message))
    assert fake.calls == ["create"] * 4  # "a" was forgotten when "c" came
