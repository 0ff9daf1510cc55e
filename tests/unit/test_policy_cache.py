"""The admission webhook's policy cache is never staler than the apiserver after a start: a LIST
before the first admission, GETs until the watch has caught up with it, and no watch backlog
bringing back a deleted policy or an older spec."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from strata_operator import certs
from strata_operator.admission.configuration import WebhookOptions
from strata_operator.admission.mutation import InjectionSettings
from strata_operator.admission.policy_cache import PolicyCache, namespace_watched
from strata_operator.admission.webhook import WebhookState
from strata_operator.cluster import list_policies
from tests.fixtures.pods import policy_obj

pytestmark = pytest.mark.unit


def _at(version: int, size: str = "2Gi", name: str = "fast") -> dict[str, Any]:
    obj = policy_obj(name, ram_size=size)
    obj["metadata"]["resourceVersion"] = str(version)
    return obj


def test_a_watch_backlog_after_the_list_does_not_bring_back_a_deleted_policy() -> None:
    cache = PolicyCache()
    cache.observe(None, _at(100))  # kopf's initial listing
    assert not cache.synced
    cache.sync([], 120)  # deleted before the webhook's LIST
    assert cache.synced and cache.get("team-a", "fast") is None
    cache.observe(None, _at(100))  # kopf's queue, still behind
    assert cache.get("team-a", "fast") is None
    cache.observe("ADDED", _at(130))  # created again
    assert cache.get("team-a", "fast") is not None
    cache.mark_unsynced()  # the webhook's watch broke
    assert not cache.synced


def test_a_watch_backlog_does_not_bring_back_an_older_spec() -> None:
    cache = PolicyCache()
    cache.sync([_at(150, "4Gi")], 151)
    cache.observe(None, _at(140, "2Gi"))
    assert cache.get("team-a", "fast")["spec"]["tiers"]["ram"]["sizeLimit"] == "4Gi"  # type: ignore[index]
    cache.observe("MODIFIED", _at(160, "8Gi"))
    cache.sync([_at(150, "4Gi")], 155)  # a LIST slower than the watch does not go back either
    assert cache.get("team-a", "fast")["spec"]["tiers"]["ram"]["sizeLimit"] == "8Gi"  # type: ignore[index]


def test_namespace_patterns_follow_kopf() -> None:
    obj = policy_obj(namespace="team-a")
    assert namespace_watched(obj, ())
    assert namespace_watched(obj, ("team-*",))
    assert not namespace_watched(obj, ("team-*", "!team-a"))
    assert not namespace_watched(obj, ("other",))


class _Apiserver:
    """The CustomObjectsApi calls the webhook makes, answered from a dict of stored policies;
    counts them."""

    def __init__(self, policies: list[dict[str, Any]], version: int) -> None:
        self.policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in policies}
        self.version = version
        self.calls: list[str] = []

    def list_cluster_custom_object(self, *_: Any, **__: Any) -> Any:
        self.calls.append("list")
        body = {
            "metadata": {"resourceVersion": str(self.version)},
            "items": list(self.policies.values()),
        }
        return SimpleNamespace(data=json.dumps(body).encode())

    def get_namespaced_custom_object(self, g: str, v: str, ns: str, p: str, name: str, **_: Any):  # type: ignore[no-untyped-def]
        from kubernetes.client.exceptions import ApiException

        self.calls.append("get")
        if (ns, name) not in self.policies:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.policies[(ns, name)])


def _state(tmp_path: Path, apiserver: _Apiserver) -> WebhookState:
    return WebhookState(
        options=WebhookOptions(),
        injection=InjectionSettings(),
        tls=certs.generate(tmp_path),
        custom_api=apiserver,
    )


def test_until_the_cache_is_synced_admissions_read_the_apiserver(tmp_path: Path) -> None:
    # kopf's initial listing delivered "fast" at 2Gi and "gone"; since then "fast" was updated to
    # 4Gi and "gone" deleted, and kopf has not delivered those events yet.
    apiserver = _Apiserver([_at(150, "4Gi")], 151)
    state = _state(tmp_path, apiserver)
    state.policies.observe(None, _at(100, "2Gi"))
    state.policies.observe(None, _at(100, name="gone"))

    async def admit_both() -> tuple[dict[str, Any], str]:
        fast = await state.get_policy("team-a", "fast")
        with pytest.raises(kopf.AdmissionError) as err:
            await state.get_policy("team-a", "gone")
        return fast, str(err.value)

    fast, refused = asyncio.run(admit_both())
    assert fast["spec"]["tiers"]["ram"]["sizeLimit"] == "4Gi"
    assert "'gone' not found" in refused
    assert apiserver.calls == ["get", "get"]
    # The webhook's own LIST is in: from then on the cache answers, without API calls.
    items, version = list_policies(apiserver)
    state.policies.sync(items, version)
    fast = asyncio.run(state.get_policy("team-a", "fast"))
    assert fast["spec"]["tiers"]["ram"]["sizeLimit"] == "4Gi"
    with pytest.raises(kopf.AdmissionError):
        asyncio.run(state.get_policy("team-a", "gone"))  # a miss is a GET (created just now?)
    assert apiserver.calls == ["get", "get", "list", "get"]
