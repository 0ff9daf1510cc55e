"""The admission webhook's policy cache is never staler than the apiserver right after an operator
restart (issue 27): policies deleted or updated while the operator starts and just after it is
ready are never used in their old form, however far behind the operator's watch still is."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from tests.fixtures.pods import PodBuilder, policy_obj

from e2e.cluster import LocalCluster
from e2e.operator_fixtures import OperatorProcess
from e2e.test_webhook import create_pod, denial

pytestmark = pytest.mark.e2e

POLICIES = 120
"""Enough policies that the restarted operator's watch is still working through them (each
gets its reconcile) while the first pods are admitted."""


@pytest.fixture
def api(k8s_cluster: LocalCluster) -> Iterator[client.ApiClient]:
    api_client = k8s_cluster.api_client()
    try:
        yield api_client
    finally:
        api_client.close()


def _ram_size(pod: dict[str, Any]) -> str:
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "strata-ram")
    return str(volume["emptyDir"]["sizeLimit"])


def test_deletes_and_updates_racing_a_restart_are_never_admitted_stale(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    custom = client.CustomObjectsApi(api)
    plural = ("strata.dev", "v1alpha1", ns, "checkpointpolicies")
    for i in range(POLICIES):
        custom.create_namespaced_custom_object(
            *plural, policy_obj(f"p-{i}", ns, ram_size="1Gi", pvc=None)
        )

    def change(i: int) -> str:
        """Delete even policies, raise the RAM tier of odd ones; the state the apiserver now
        holds for p-i ("deleted" or the new sizeLimit)."""
        if i % 2 == 0:
            custom.delete_namespaced_custom_object(*plural, f"p-{i}")
            return "deleted"
        custom.patch_namespaced_custom_object(
            *plural, f"p-{i}", {"spec": {"tiers": {"ram": {"sizeLimit": "3Gi"}}}}
        )
        return "3Gi"

    def admit(i: int) -> str:
        pod = PodBuilder(f"pod-{i}", ns).policy(f"p-{i}").container("train").obj()
        try:
            created = create_pod(api, ns, pod)
        except ApiException as exc:
            message = denial(exc)
            assert exc.status == 403 and "not found" in message, (exc.status, message)
            return "deleted"
        return _ram_size(created)

    expected: dict[int, str] = {}
    operator_running.stop()
    # A third of the changes while the operator starts, the rest in a burst just after it is
    # ready, while its kopf queues still work through the policies' reconciles.
    starter = threading.Thread(target=operator_running.start)
    starter.start()
    for i in range(POLICIES // 3):
        expected[i] = change(i)
    starter.join()
    assert operator_running.alive(), operator_running.log_tail()
    seen = _Published(custom, ns, _list_version(custom, ns))
    got: dict[int, str] = {}
    try:
        for i in range(POLICIES // 3, POLICIES):
            expected[i] = change(i)
            # Informer semantics: a change must be used once the apiserver has published it to
            # watchers (a watch of this test has seen it) and the webhook's cache says it has
            # applied that version; kopf's queues, seconds behind just after a start, must not
            # matter (before: 32 of these 80 pods stale, without the wait on the cache).
            version = seen.wait_for(f"p-{i}")
            _wait_applied(operator_running, version)
            got[i] = admit(i)
    finally:
        seen.stop()
    got |= {i: admit(i) for i in range(POLICIES // 3)}
    stale = {i: (got[i], expected[i]) for i in expected if got[i] != expected[i]}
    assert not stale, f"{len(stale)} pods admitted with a stale policy (got, apiserver): {stale}"


def _wait_applied(op: OperatorProcess, version: int) -> None:
    """Until the operator's policy cache reports ``version`` applied (at most 60 s)."""
    deadline = time.monotonic() + 60
    while op.metric("strata_admission_policy_cache_resource_version") < version:
        assert time.monotonic() < deadline, f"the policy cache never applied version {version}"
        time.sleep(0.01)


def _list_version(custom: client.CustomObjectsApi, ns: str) -> str:
    listing = custom.list_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies"
    )
    return str(listing["metadata"]["resourceVersion"])  # type: ignore[index]


class _Published:
    """A watch of the namespace's policies from ``version``, in a thread: :meth:`wait_for`
    returns once it has seen a change of the named policy (fails after 60 s)."""

    def __init__(self, custom: client.CustomObjectsApi, ns: str, version: str) -> None:
        self._names: dict[str, int] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, args=(custom, ns, version), daemon=True)
        self._thread.start()

    def _run(self, custom: client.CustomObjectsApi, ns: str, version: str) -> None:
        try:
            for event in self._watch.stream(  # type: ignore[no-untyped-call]
                custom.list_namespaced_custom_object,
                "strata.dev",
                "v1alpha1",
                ns,
                "checkpointpolicies",
                resource_version=version,
                timeout_seconds=300,
            ):
                with self._cond:
                    meta = event["object"]["metadata"]
                    self._names[meta["name"]] = int(meta["resourceVersion"])
                    self._cond.notify_all()
        except Exception:
            if not self._stopping:
                raise

    def wait_for(self, name: str) -> int:
        """The resourceVersion of the change of ``name`` the watch saw."""
        with self._cond:
            assert self._cond.wait_for(lambda: name in self._names, timeout=60), name
            return self._names[name]

    def stop(self) -> None:
        self._stopping = True
        self._watch.stop()  # type: ignore[no-untyped-call]
