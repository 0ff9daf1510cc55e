"""Leader election of the operator's replicas (:mod:`strata_operator.leadership`).

No cluster: an in-memory Lease API with the apiserver's optimistic concurrency (a replace must
carry the stored resourceVersion) stands in for ``coordination.k8s.io/v1``; the election itself
is the Kubernetes client's, run for real with 1-second periods.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from strata_operator import main
from strata_operator.leadership import ElectionTiming, LeaderElector

pytestmark = pytest.mark.unit

FAST = ElectionTiming(lease_duration=3, renew_deadline=2, retry_period=1)


def _error(status: int, reason: str) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "code": status, "reason": reason})
    return exc


class FakeLeases:
    """``CoordinationV1Api`` for one namespace, resourceVersion-checked like the apiserver."""

    def __init__(self) -> None:
        self.leases: dict[str, Any] = {}
        self.version = 0
        self.lock = threading.Lock()
        self.holders: list[str | None] = []

    def _stored(self, lease: Any) -> Any:
        self.version += 1
        lease = copy.deepcopy(lease)
        meta = lease.metadata
        if isinstance(meta, dict):
            meta = client.V1ObjectMeta(name=meta["name"])
        meta.resource_version = str(self.version)
        lease.metadata = meta
        self.leases[meta.name] = lease
        holder = lease.spec.holder_identity if lease.spec else None
        if not self.holders or self.holders[-1] != holder:
            self.holders.append(holder)
        return copy.deepcopy(lease)

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Any:
        with self.lock:
            if name not in self.leases:
                raise _error(404, "NotFound")
            return copy.deepcopy(self.leases[name])

    def create_namespaced_lease(self, namespace: str, body: Any, **_: Any) -> Any:
        with self.lock:
            name = body.metadata["name"] if isinstance(body.metadata, dict) else body.metadata.name
            if name in self.leases:
                raise _error(409, "AlreadyExists")
            return self._stored(body)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **_: Any) -> Any:
        with self.lock:
            current = self.leases.get(name)
            if current is None:
                raise _error(404, "NotFound")
            if body.metadata.resource_version != current.metadata.resource_version:
                raise _error(409, "Conflict")
            return self._stored(body)

    def holder(self, name: str = "strata") -> str | None:
        lease = self.leases.get(name)
        return lease.spec.holder_identity if lease and lease.spec else None


class Replica:
    """One candidate whose leader work records when it ran."""

    def __init__(self, api: FakeLeases, identity: str) -> None:
        self.running = threading.Event()
        self.failed = threading.Event()
        self.elector = LeaderElector(
            namespace="ns",
            name="strata",
            identity=identity,
            lead=self.lead,
            timing=FAST,
            on_failure=self.failed.set,
            api=api,
        )

    def lead(self, stop: threading.Event) -> None:
        self.running.set()
        try:
            stop.wait()
        finally:
            self.running.clear()

    def crash(self) -> None:
        """What SIGKILL leaves: no more writes, no release, the work gone."""
        self.elector._lock.stopping.set()
        self.elector._closing.set()
        self.elector._lead_stop.set()


def _wait(predicate: Any, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError("timed out")
        time.sleep(0.05)
    return time.monotonic() - start


def test_timing_is_checked_with_a_message_naming_the_conflict() -> None:
    with pytest.raises(ValueError, match=r"lease duration .* must exceed the renew deadline"):
        ElectionTiming(lease_duration=10, renew_deadline=10, retry_period=2)
    with pytest.raises(ValueError, match=r"renew deadline .* 1.2 x the retry period"):
        ElectionTiming(lease_duration=15, renew_deadline=2, retry_period=2)
    with pytest.raises(ValueError, match="at least 1 s"):
        ElectionTiming(retry_period=0)


def test_one_replica_leads_and_a_graceful_stop_hands_over_within_a_retry_period() -> None:
    api = FakeLeases()
    a, b = Replica(api, "a"), Replica(api, "b")
    a.elector.start()
    _wait(a.running.is_set, 5)
    b.elector.start()
    time.sleep(2 * FAST.retry_period)
    assert api.holder() == "a" and a.elector.is_leader
    assert not b.running.is_set() and not b.elector.is_leader
    a.elector.stop(grace=5)
    assert not a.running.is_set()
    handover = _wait(b.running.is_set, 5)
    # Released (holder cleared): no wait for the lease duration.
    assert handover < FAST.lease_duration
    assert api.holders == ["a", None, "b"]
    time.sleep(2 * FAST.retry_period)  # a stopped elector never takes the Lease back
    assert api.holder() == "b" and not a.running.is_set()
    b.elector.stop(grace=5)
    assert api.holder() is None
    assert not a.failed.is_set() and not b.failed.is_set()


def test_a_killed_leader_is_replaced_after_the_lease_duration() -> None:
    api = FakeLeases()
    a, b = Replica(api, "a"), Replica(api, "b")
    a.elector.start()
    _wait(a.running.is_set, 5)
    b.elector.start()
    time.sleep(FAST.retry_period)
    a.crash()
    killed = time.monotonic()
    _wait(b.running.is_set, FAST.lease_duration + 3 * FAST.retry_period)
    failover = time.monotonic() - killed
    assert FAST.lease_duration - FAST.retry_period <= failover
    assert failover <= FAST.lease_duration + 2 * FAST.retry_period
    assert api.holder() == "b"
    b.elector.stop(grace=5)


def test_work_that_ends_by_itself_stops_the_operator() -> None:
    api = FakeLeases()
    failed = threading.Event()
    elector = LeaderElector(
        namespace="ns",
        name="strata",
        identity="a",
        lead=lambda stop: None,
        timing=FAST,
        on_failure=failed.set,
        api=api,
    )
    elector.start()
    _wait(failed.is_set, 5)
    elector.stop(grace=1)


def test_leader_only_roles_register_into_the_leaders_registry(tmp_path: Any) -> None:
    extensions = main.default_extensions()
    argv = ["--tls-workdir", str(tmp_path), "--metrics-port", "0", "--leader-elect"]
    args = main.build_parser(extensions).parse_args(argv)
    everyone, leader = main.build_registries(args, main.build_wiring(args), extensions)

    def ids(registry: Any, kind: str) -> set[str]:
        return {str(h.id) for h in getattr(registry, kind).get_all_handlers()}

    # Admission on every replica: the webhooks and the policy cache's feed.
    assert "inject-pods" in ids(everyone, "_webhooks")
    assert ids(everyone, "_watching") == {"policy_event"}
    assert ids(everyone, "_changing") == set()
    assert "start_webhook_server" in ids(everyone, "_activities")
    # What writes policies only on the leader.
    assert ids(leader, "_webhooks") == set()
    assert ids(leader, "_changing") == {"reconcile_policy"}
    assert ids(leader, "_watching") == {"pvc_changed", "labelled_pod"}
    assert {"start_receiver", "stop_receiver", "tune_kopf"} <= ids(leader, "_activities")


class FlakyLeases(FakeLeases):
    """Leases whose writes fail while ``down`` is set (the apiserver unreachable)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()

    def replace_namespaced_lease(self, *args: Any, **kwargs: Any) -> Any:
        if self.down.is_set():
            raise _error(503, "ServiceUnavailable")
        return super().replace_namespaced_lease(*args, **kwargs)


def test_a_leader_that_cannot_renew_stops_its_work_and_leads_again_later() -> None:
    api = FlakyLeases()
    runs: list[str] = []

    def lead(stop: threading.Event) -> None:
        runs.append("start")
        stop.wait()
        runs.append("stop")

    elector = LeaderElector(
        namespace="ns", name="strata", identity="a", lead=lead, timing=FAST, api=api
    )
    elector.start()
    _wait(lambda: runs == ["start"], 5)
    api.down.set()
    # Not renewed for the renew deadline: the work is told to stop, the role is standby.
    stopped = _wait(lambda: runs == ["start", "stop"], FAST.renew_deadline + 3 * FAST.retry_period)
    assert stopped >= FAST.renew_deadline - FAST.retry_period
    assert not elector.is_leader
    api.down.clear()
    _wait(lambda: runs == ["start", "stop", "start"], FAST.lease_duration + 4 * FAST.retry_period)
    assert elector.is_leader
    assert [leading for _, leading in elector.transitions] == [True, False, True]
    elector.stop(grace=5)
    assert runs[-1] == "stop" and api.holder() is None


def test_lease_timings_that_cannot_work_stop_the_operator_with_a_message(tmp_path: Any) -> None:
    argv = ["--tls-workdir", str(tmp_path), "--metrics-port", "0", "--leader-elect"]
    args = main.build_parser().parse_args([*argv, "--lease-duration=5", "--renew-deadline=5"])
    _, leader = main.build_registries(args, main.build_wiring(args), [])
    with pytest.raises(ValueError, match="must exceed the renew deadline"):
        main.ElectedOperator(args, leader, threading.Event())
