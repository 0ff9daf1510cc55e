"""The operator against a real kube-apiserver: CRD admission, reconcile, restarts, C-13.

The operator runs as a real subprocess (``python -m strata_operator``) with the session's
kubeconfig, bucket checks going to a real fake-gcs-server (``STORAGE_EMULATOR_HOST``). Invalid
policies are sent with ``fieldValidation=Strict`` (what ``kubectl apply`` does by default): with
the default ``Warn`` the apiserver would silently prune unknown fields instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tests.fixtures.policies import InvalidCase, PolicyBuilder, invalid_policies

from e2e.cluster import LOOPBACK_NO_PROXY, ClusterError, LocalCluster, free_port
from strata_operator import api, crdgen
from strata_operator import constants as k
from strata_operator.api import conditions as c
from strata_operator.reconcile.policy import InvalidSpec, parse_spec

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
CRD_FILE = REPO / "crds" / f"{api.PLURAL}.{api.GROUP}.yaml"
WAIT = 60.0
"""Upper bound of every wait (seconds); tests assert outcomes, never durations."""

Obj = dict[str, Any]


def wait_for(what: str, probe: Callable[[], Any], timeout: float = WAIT) -> Any:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}; last value: {last!r}")


class Operator:
    """``python -m strata_operator`` as a subprocess (own process group, log file)."""

    def __init__(self, cluster: LocalCluster, log_dir: Path, gcs_endpoint: str | None) -> None:
        self.cluster = cluster
        self.log_dir = log_dir
        self.gcs_endpoint = gcs_endpoint
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self, *extra: str, gcs_endpoint: str | None = None, gcs_timeout: float = 5) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.port = free_port()
        env = {
            **os.environ,
            "NO_PROXY": LOOPBACK_NO_PROXY,
            "no_proxy": LOOPBACK_NO_PROXY,
            # google-auth would probe the GCE metadata server (off-loopback) without this.
            "NO_GCE_CHECK": "true",
        }
        endpoint = gcs_endpoint or self.gcs_endpoint
        if endpoint:
            env["STORAGE_EMULATOR_HOST"] = endpoint
        cmd = [
            sys.executable,
            "-m",
            "strata_operator",
            "--kubeconfig",
            str(self.cluster.kubeconfig),
            "--liveness",
            f"http://127.0.0.1:{self.port}/healthz",
            "--dependency-retry",
            "1",
            "--gcs-timeout",
            str(gcs_timeout),
            "--verbose",
            # The webhook and report receiver (other modules of this operator) on loopback
            # and free ports, so that successive operators in one session never collide.
            "--webhook-listen",
            "127.0.0.1",
            "--webhook-port",
            str(free_port()),
            # These tests exercise reconcile only: never point the cluster's shared webhook
            # configuration at an operator that is about to be killed.
            "--no-manage-webhook",
            "--report-port",
            "0",
            "--metrics-port",
            "0",
            *extra,
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        wait_for("the operator's liveness endpoint", self.healthy)

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as the kernel's OOM killer or a node failure would."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM and wait (kopf exits gracefully); SIGKILL if it does not."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            pytest.fail(f"operator ignored SIGTERM:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def errors(self) -> list[str]:
        """Tracebacks in the log other than kopf's reports of handler errors we raise."""
        text = self.log.read_text(errors="replace")
        return [line for line in text.splitlines() if line.startswith("Traceback")]


@pytest.fixture(scope="module")
def crd(k8s_cluster: LocalCluster) -> None:
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))

    def established() -> bool:
        got = k8s_cluster.request(
            f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{api.PLURAL}.{api.GROUP}"
        )
        conds = (got.get("status") or {}).get("conditions") or []
        return any(x["type"] == "Established" and x["status"] == "True" for x in conds)

    wait_for("the CRD to be Established", established)


@pytest.fixture(scope="module")
def kube(k8s_cluster: LocalCluster) -> Iterator[Any]:
    api_client = k8s_cluster.api_client()
    try:
        yield api_client
    finally:
        api_client.close()


@pytest.fixture
def operator(
    k8s_cluster: LocalCluster, crd: None, gcs_emulator: Any, tmp_path: Path
) -> Iterator[Operator]:
    op = Operator(k8s_cluster, tmp_path, gcs_emulator.endpoint)
    op.start()
    try:
        yield op
    finally:
        code = op.stop()
        assert code == 0, f"operator did not exit cleanly ({code}):\n{op.tail()}"


# --- helpers ----------------------------------------------------------------------------------


def create_policy(kube: Any, body: Obj, *, strict: bool = True) -> Obj:
    return client.CustomObjectsApi(kube).create_namespaced_custom_object(  # type: ignore[no-any-return]
        api.GROUP,
        api.VERSION,
        body["metadata"]["namespace"],
        api.PLURAL,
        body,
        field_validation="Strict" if strict else "Warn",
    )


def get_policy(kube: Any, namespace: str, name: str) -> Obj:
    return client.CustomObjectsApi(kube).get_namespaced_custom_object(  # type: ignore[no-any-return]
        api.GROUP, api.VERSION, namespace, api.PLURAL, name
    )


def patch_policy(kube: Any, namespace: str, name: str, patch: Obj) -> Obj:
    return client.CustomObjectsApi(kube).patch_namespaced_custom_object(  # type: ignore[no-any-return]
        api.GROUP,
        api.VERSION,
        namespace,
        api.PLURAL,
        name,
        patch,
        _content_type="application/merge-patch+json",
    )


def condition(policy: Obj, type_: str) -> Obj | None:
    found = c.find((policy.get("status") or {}).get("conditions") or [], type_)
    return dict(found) if found is not None else None


def wait_ready(
    kube: Any, namespace: str, name: str, status: str = "True", generation: int | None = None
) -> Obj:
    def probe() -> Obj | None:
        policy = get_policy(kube, namespace, name)
        ready = condition(policy, k.READY)
        gen = generation or policy["metadata"]["generation"]
        if (
            ready is not None
            and ready["status"] == status
            and policy["status"].get("observedGeneration") == gen
        ):
            return policy
        return None

    return wait_for(f"{namespace}/{name} Ready={status}", probe)  # type: ignore[no-any-return]


def create_pvc(
    kube: Any, namespace: str, name: str, mode: str = "ReadWriteMany", bound: bool = True
) -> None:
    """A claim; ``bound``: with a PersistentVolume made for it, returning once it is Bound
    (the PV controller binds them); else it stays Pending (no StorageClass provisions it)."""
    core: Any = client.CoreV1Api(kube)  # plain dicts in, as the API takes them
    pv = f"{namespace}-{name}"[:63]
    spec: Obj = {
        "accessModes": [mode],
        "resources": {"requests": {"storage": "1Gi"}},
        "storageClassName": "",
    }
    if bound:
        create_pv_for(kube, namespace, name, mode)
        spec["volumeName"] = pv
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": spec,
        },
    )
    if bound:
        wait_for(
            f"PVC {namespace}/{name} Bound",
            lambda: (
                core.read_namespaced_persistent_volume_claim(name, namespace).status.phase
                == "Bound"
            ),
        )


def create_pv_for(kube: Any, namespace: str, name: str, mode: str = "ReadWriteMany") -> None:
    """A PersistentVolume reserved (claimRef) for the claim ``namespace/name``."""
    core: Any = client.CoreV1Api(kube)
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-{name}"[:63]},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": [mode],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/strata-e2e-pv/{namespace}/{name}"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        }
    )


def events_for(kube: Any, namespace: str, name: str) -> list[Obj]:
    raw = client.CoreV1Api(kube).list_namespaced_event(
        namespace,
        field_selector=f"involvedObject.name={name}",
        _preload_content=False,
    )
    return list(json.loads(raw.data)["items"])


def namespace_gone(kube: Any, name: str) -> bool:
    try:
        client.CoreV1Api(kube).read_namespace(name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def new_namespace(kube: Any, labels: dict[str, str] | None = None) -> str:
    name = f"ckpol-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(kube).create_namespace(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels or {}},
        }
    )
    return name


def assert_no_strata_finalizer_or_status_litter(policy: Obj) -> None:
    meta = policy["metadata"]
    assert not [f for f in meta.get("finalizers") or [] if "strata" in f or "kopf" in f]
    for key in meta.get("annotations") or {}:
        assert not key.startswith("kopf.zalando.org"), key
    assert set(policy.get("status") or {}) <= {
        "observedGeneration",
        "conditions",
        "jobs",
        "newestCompleteStep",
    }


# --- tests ------------------------------------------------------------------------------------


def test_valid_policies_become_ready_with_the_expected_status(
    operator: Operator, kube: Any, k8s_namespace: str, gcs_bucket: str, k8s_cluster: LocalCluster
) -> None:
    ns = k8s_namespace
    create_pvc(kube, ns, "ckpt")
    full = (
        PolicyBuilder("full", ns)
        .pvc("ckpt", steps=None, every={"steps": 100, "duration": "10m"})
        .gcs(gcs_bucket, steps=None, every={"steps": 1000, "duration": "1h"}, prefix="runs")
        .restore(order=["ram", "pvc", "gcs"])
    )
    create_policy(kube, full.obj())
    create_policy(kube, PolicyBuilder("ram-only", ns).obj())

    policy = wait_ready(kube, ns, "full")
    ready, degraded = condition(policy, k.READY), condition(policy, k.DEGRADED)
    assert ready is not None and degraded is not None
    assert (ready["reason"], ready["observedGeneration"]) == (k.REASON_RECONCILED, 1)
    assert "tiers: ram, pvc, gcs" in ready["message"]
    assert (degraded["status"], degraded["reason"]) == ("False", k.REASON_AS_EXPECTED)
    assert policy["status"]["observedGeneration"] == 1
    # apiserver defaults from the CRD
    assert policy["spec"]["tiers"]["ram"]["medium"] == "Memory"
    assert policy["spec"]["tiers"]["pvc"]["keep"] == 2
    assert policy["spec"]["restore"]["verify"] is True
    assert_no_strata_finalizer_or_status_litter(policy)
    # kopf records what it handled in its own (strata.dev/) annotations right after the
    # handler returns, i.e. possibly just after the status patch this test waited for.
    wait_for(
        "kopf's strata.dev/ annotations",
        lambda: any(
            k.startswith("strata.dev/")
            for k in get_policy(kube, ns, "full")["metadata"].get("annotations") or {}
        ),
    )

    ram_only = wait_ready(kube, ns, "ram-only")
    assert "tiers: ram" in (condition(ram_only, k.READY) or {})["message"]

    # Events are posted after the status patch: the Ready event exists once Ready is set.
    events = wait_for(
        "the Reconciled event",
        lambda: [e for e in events_for(kube, ns, "full") if e["reason"] == "Reconciled"],
    )
    assert events[0]["type"] == "Normal"

    table = k8s_cluster.kubectl("get", "ckpol", "-n", ns)
    assert table.split("\n")[0].split() == ["NAME", "READY", "RAM", "PVC", "GCS", "AGE"]
    assert "full" in table and "True" in table
    assert "ram-only" in k8s_cluster.kubectl("get", "strata", "-n", ns)


CASES = list(invalid_policies())


@pytest.fixture(scope="class")
def invalid_ns(kube: Any, crd: None) -> Iterator[str]:
    name = new_namespace(kube)
    yield name
    client.CoreV1Api(kube).delete_namespace(name)


@pytest.fixture(scope="class")
def class_operator(
    k8s_cluster: LocalCluster,
    crd: None,
    gcs_emulator: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Operator]:
    op = Operator(k8s_cluster, tmp_path_factory.mktemp("operator"), gcs_emulator.endpoint)
    op.start()
    yield op
    op.stop()


class TestInvalidPolicies:
    """Generated invalid policies (tests/fixtures/policies.py), one operator for all of them."""

    @pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
    def test_rejected_by_the_apiserver_with_a_message(
        self, case: InvalidCase, kube: Any, invalid_ns: str, class_operator: Operator
    ) -> None:
        body = {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": f"bad-{uuid.uuid4().hex[:8]}", "namespace": invalid_ns},
            "spec": case.spec,
        }
        with pytest.raises(ApiException) as err:
            create_policy(kube, body)
        assert err.value.status in (400, 422), err.value.body
        message = json.loads(err.value.body)["message"]
        assert case.expect.lower() in message.lower(), message
        assert class_operator.alive(), class_operator.tail()

    def test_unknown_fields_kubectl_rejects_and_lenient_clients_lose(
        self, kube: Any, k8s_cluster: LocalCluster, invalid_ns: str
    ) -> None:
        """kubectl validates strictly by default; a client asking for Warn gets the field
        pruned (silently losing the setting), which is why the docs say to use kubectl."""
        body = PolicyBuilder("typo", invalid_ns).ram(sizeLimt="1Gi").obj()
        with pytest.raises(ClusterError) as err:
            k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        assert 'unknown field "spec.tiers.ram.sizeLimt"' in str(err.value)
        stored = create_policy(kube, body, strict=False)
        assert "sizeLimt" not in stored["spec"]["tiers"]["ram"]

    def test_operator_survives_all_invalid_input(
        self, class_operator: Operator, kube: Any, invalid_ns: str
    ) -> None:
        """After every rejected request the operator still reconciles a valid policy."""
        create_policy(kube, PolicyBuilder("after-invalid", invalid_ns).obj())
        wait_ready(kube, invalid_ns, "after-invalid")
        wait_ready(kube, invalid_ns, "typo")
        assert class_operator.alive() and class_operator.errors() == []


def test_policies_the_schema_cannot_judge_are_not_ready_with_what_to_fix(
    operator: Operator, kube: Any, gcs_bucket: str
) -> None:
    ns = new_namespace(kube)
    restricted = new_namespace(kube, {"pod-security.kubernetes.io/enforce": "restricted"})
    try:
        create_pvc(kube, ns, "rwo", mode="ReadWriteOnce")
        cases: list[tuple[Obj, str, str]] = [
            (PolicyBuilder("no-pvc", ns).pvc("missing").obj(), k.REASON_PVC_NOT_FOUND, "'missing'"),
            (
                PolicyBuilder("no-bucket", ns).gcs("strata-no-such-bucket").obj(),
                k.REASON_BUCKET_NOT_FOUND,
                "gs://strata-no-such-bucket",
            ),
            (
                PolicyBuilder("no-secret", ns)
                .gcs(gcs_bucket, credentials={"type": "SecretRef", "secretRef": {"name": "sa"}})
                .obj(),
                k.REASON_SECRET_NOT_FOUND,
                "Secret 'sa'",
            ),
            (
                PolicyBuilder("host-path", restricted).ram(medium="HostPath").obj(),
                k.REASON_HOST_PATH_FORBIDDEN,
                "medium: Memory",
            ),
        ]
        for body, _, _ in cases:
            create_policy(kube, body)
        for body, reason, fix in cases:
            meta = body["metadata"]
            policy = wait_ready(kube, meta["namespace"], meta["name"], status="False")
            ready = condition(policy, k.READY)
            assert ready is not None and ready["reason"] == reason, ready
            assert fix in ready["message"]
            warnings = wait_for(
                f"a Warning event for {meta['name']}",
                lambda m=meta: [
                    e for e in events_for(kube, m["namespace"], m["name"]) if e["type"] == "Warning"
                ],
            )
            assert any(e["reason"] == reason for e in warnings)

        # A PVC that is not ReadWriteMany works for one pod: Ready, but Degraded says why.
        create_policy(kube, PolicyBuilder("rwo", ns).pvc("rwo").obj())
        policy = wait_ready(kube, ns, "rwo")
        degraded = condition(policy, k.DEGRADED)
        assert degraded is not None and degraded["reason"] == k.REASON_PVC_NOT_SHARED

        # The operator retried the missing PVC every second meanwhile, but said it once.
        no_pvc_events = events_for(kube, ns, "no-pvc")
        assert [e["reason"] for e in no_pvc_events] == [k.REASON_PVC_NOT_FOUND]

        # Creating the missing PVC fixes the policy without touching it.
        create_pvc(kube, ns, "missing")
        policy = wait_ready(kube, ns, "no-pvc")
        assert policy["metadata"]["generation"] == 1
        assert operator.alive()
    finally:
        client.CoreV1Api(kube).delete_namespace(ns)
        client.CoreV1Api(kube).delete_namespace(restricted)


def test_invalid_policies_stored_under_a_looser_schema_are_not_ready_with_what_to_fix(
    k8s_cluster: LocalCluster, crd: None, kube: Any, gcs_emulator: Any, tmp_path: Path
) -> None:
    """Objects written before the CRD got stricter (or under a hand-edited CRD) are judged by
    the operator with the same rules: every generated invalid spec is Ready=False InvalidSpec
    with a message naming the field."""
    loose = crdgen.crd()
    version = loose["spec"]["versions"][0]
    version["schema"]["openAPIV3Schema"]["properties"]["spec"] = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    ns = new_namespace(kube)
    op = Operator(k8s_cluster, tmp_path, gcs_emulator.endpoint)
    names: dict[str, InvalidCase] = {}
    try:
        k8s_cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(loose)
        )
        for n, case in enumerate(CASES):
            body = {
                "apiVersion": api.API_VERSION,
                "kind": api.KIND,
                "metadata": {"name": f"stored-{n:03d}", "namespace": ns},
                "spec": case.spec,
            }
            # The apiserver may serve the previous schema for a moment after the update.
            wait_for(f"{case.id} to be stored", lambda b=body: _try_create(kube, b))
            names[body["metadata"]["name"]] = case
        op.start()
        for name, case in names.items():
            policy = wait_ready(kube, ns, name, status="False")
            ready = condition(policy, k.READY)
            assert ready is not None and ready["reason"] == k.REASON_INVALID_SPEC, (case.id, ready)
            assert case.expect.lower() in ready["message"].lower(), (case.id, ready["message"])
        assert op.alive() and op.errors() == []
    finally:
        op.stop()
        k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        client.CoreV1Api(kube).delete_namespace(ns)


def _try_create(kube: Any, body: Obj) -> bool:
    try:
        create_policy(kube, body)
    except ApiException as exc:
        if exc.status in (400, 422):
            return False
        raise
    return True


def test_update_bumps_observed_generation_and_conditions(
    operator: Operator, kube: Any, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    create_pvc(kube, ns, "ckpt")
    create_policy(kube, PolicyBuilder("p", ns).pvc("ckpt").obj())
    first = condition(wait_ready(kube, ns, "p", generation=1), k.READY)
    assert first is not None

    patch_policy(kube, ns, "p", {"spec": {"tiers": {"pvc": {"claimName": "other"}}}})
    broken = condition(wait_ready(kube, ns, "p", status="False", generation=2), k.READY)
    assert broken is not None and broken["reason"] == k.REASON_PVC_NOT_FOUND
    assert broken["observedGeneration"] == 2
    assert broken["lastTransitionTime"] >= first["lastTransitionTime"]

    patch_policy(kube, ns, "p", {"spec": {"tiers": {"pvc": {"claimName": "ckpt"}}}})
    fixed = condition(wait_ready(kube, ns, "p", generation=3), k.READY)
    assert fixed is not None and fixed["reason"] == k.REASON_RECONCILED

    # A change that keeps the policy Ready moves observedGeneration, not lastTransitionTime.
    patch_policy(kube, ns, "p", {"spec": {"tiers": {"pvc": {"keep": 5}}}})
    same = condition(wait_ready(kube, ns, "p", generation=4), k.READY)
    assert same is not None and same["observedGeneration"] == 4
    assert same["lastTransitionTime"] == fixed["lastTransitionTime"]


class Blackhole:
    """A loopback TCP server that accepts requests and never answers (a hung GCS endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.requests = threading.Event()
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            with contextlib.suppress(OSError):
                if conn.recv(4096):
                    self.requests.set()

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.sock.close()


def test_operator_killed_mid_reconcile_converges_after_restart(
    k8s_cluster: LocalCluster,
    crd: None,
    kube: Any,
    k8s_namespace: str,
    gcs_emulator: Any,
    gcs_bucket: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    hole = Blackhole()
    op = Operator(k8s_cluster, tmp_path, gcs_emulator.endpoint)
    try:
        # The bucket check hangs on the blackhole: the reconcile is in flight when we kill.
        op.start(gcs_endpoint=hole.endpoint, gcs_timeout=120)
        create_policy(kube, PolicyBuilder("p", ns).gcs(gcs_bucket).obj())
        wait_for("the operator's bucket check to reach GCS", hole.requests.is_set)
        op.kill()
        policy = get_policy(kube, ns, "p")
        assert condition(policy, k.READY) is None, "the reconcile had not finished"

        op.start()  # the real emulator this time
        policy = wait_ready(kube, ns, "p", generation=1)
        assert (condition(policy, k.READY) or {})["reason"] == k.REASON_RECONCILED
        assert_no_strata_finalizer_or_status_litter(policy)
        assert op.errors() == []
    finally:
        op.stop()
        hole.close()


@pytest.mark.parametrize("operator_state", ["running", "stopped"])
def test_c13_namespace_with_a_policy_terminates_with_the_operator_running_or_stopped(
    operator_state: str,
    k8s_cluster: LocalCluster,
    crd: None,
    kube: Any,
    gcs_emulator: Any,
    tmp_path: Path,
) -> None:
    ns = new_namespace(kube)
    create_pvc(kube, ns, "ckpt")
    op = Operator(k8s_cluster, tmp_path, gcs_emulator.endpoint)
    op.start()
    try:
        create_policy(kube, PolicyBuilder("p", ns).pvc("ckpt").obj())
        create_policy(kube, PolicyBuilder("broken", ns).pvc("missing").obj())
        policy = wait_ready(kube, ns, "p")
        wait_ready(kube, ns, "broken", status="False")
        assert_no_strata_finalizer_or_status_litter(policy)
        # A training pod naming the policy (injected by this operator's webhook).
        pod = client.CoreV1Api(kube).create_namespaced_pod(
            ns,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "trainer", "labels": {"strata.dev/policy": "p"}},
                "spec": {
                    "containers": [{"name": "train", "image": "python:3.11"}],
                    "nodeSelector": {"strata.dev/test": "no-such-node"},
                },
            },
            _preload_content=False,
        )
        pod_meta = json.loads(pod.data)["metadata"]
        assert not [f for f in pod_meta.get("finalizers") or [] if "strata" in f]
        if operator_state == "stopped":
            op.stop()
        client.CoreV1Api(kube).delete_namespace(ns)
        wait_for(f"namespace {ns} to terminate", lambda: namespace_gone(kube, ns), timeout=90)
        if operator_state == "running":
            assert op.alive() and op.errors() == []
    finally:
        op.stop()


# --- issue 15 ---------------------------------------------------------------------------------


def test_a_created_pvc_makes_its_policy_ready_at_once_not_at_the_next_retry(
    k8s_cluster: LocalCluster, crd: None, kube: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    """Status reacts to the dependency, not to kopf's retry timer: with a retry of 10 minutes
    the policy still becomes Ready once its PVC exists (before: 18-28 s with a 30 s retry), and
    turns Ready=False again when the PVC is deleted."""
    ns = k8s_namespace
    op = Operator(k8s_cluster, tmp_path, None)
    op.start("--dependency-retry", "600", "--no-bucket-check")
    try:
        create_policy(kube, PolicyBuilder("waits", ns).pvc("later").obj())
        missing = condition(wait_ready(kube, ns, "waits", status="False"), k.READY)
        assert missing is not None and missing["reason"] == k.REASON_PVC_NOT_FOUND
        create_pvc(kube, ns, "later")
        ready = condition(wait_ready(kube, ns, "waits"), k.READY)
        assert ready is not None and ready["reason"] == k.REASON_RECONCILED
        client.CoreV1Api(kube).delete_namespaced_persistent_volume_claim("later", ns)
        gone = condition(wait_ready(kube, ns, "waits", status="False"), k.READY)
        assert gone is not None and gone["reason"] == k.REASON_PVC_NOT_FOUND
        reasons = [e["reason"] for e in events_for(kube, ns, "waits")]
        assert reasons.count(k.REASON_RECONCILED) == 1, reasons
        assert op.alive() and op.errors() == []
    finally:
        op.stop()


def test_a_ready_change_that_repeats_is_counted_in_one_event_not_posted_again(
    k8s_cluster: LocalCluster, crd: None, kube: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    """Issue 30 item 6: the PVC goes away twice, so the policy says the same PVCNotFound twice;
    its Events hold one PVCNotFound whose series counts 2 (kubectl describe: "x2"), and one
    Reconciled Event likewise."""
    ns = k8s_namespace
    op = Operator(k8s_cluster, tmp_path, None)
    op.start("--dependency-retry", "600", "--no-bucket-check")
    try:
        create_policy(kube, PolicyBuilder("flaps", ns).pvc("claim").obj())
        wait_ready(kube, ns, "flaps", status="False")
        for _ in range(2):
            create_pvc(kube, ns, "claim", bound=False)  # Pending: Ready (and Degraded) all the same
            wait_ready(kube, ns, "flaps")
            client.CoreV1Api(kube).delete_namespaced_persistent_volume_claim("claim", ns)
            wait_for(
                "the PVC to be gone",
                lambda: (
                    not [
                        p
                        for p in client.CoreV1Api(kube)
                        .list_namespaced_persistent_volume_claim(ns)
                        .items
                        if p.metadata.name == "claim"
                    ]
                ),
            )
            wait_ready(kube, ns, "flaps", status="False")

        def counts() -> dict[str, list[int]]:
            found: dict[str, list[int]] = {}
            for e in events_for(kube, ns, "flaps"):
                found.setdefault(e["reason"], []).append((e.get("series") or {}).get("count", 1))
            return found

        want = {k.REASON_PVC_NOT_FOUND: [3], k.REASON_RECONCILED: [2]}
        wait_for(f"events counted as {want}", lambda: counts() == want)
        assert op.alive() and op.errors() == []
    finally:
        op.stop()


SIZE_SPELLINGS = (
    *("1Gi", "1e9", "1E9", "1e+9", "1.5Gi", ".5Gi", "+1Gi", "1073741824", "0.001Ti", "1000000k"),
    *("16G", "32Ti", "1.e9", "1.", "33Ti", "1Ki", "2E", "1e1.5", "1K", "1gi", "1_000000000"),
    *("0x10", "Infinity", "1e400", "1Mi", "1048575"),
)
DURATION_SPELLINGS = (
    *("1s", "1.5s", "1000ms", "999ms", "90s", "1h30m", "1h1.5m", "2562047h", "2562048h", "1d"),
    *("0.5s", "1000000us", "1000000µs", "1000000000ns", "1m0s", "-1s", "+1s", "1.s", "1h "),
)

ACCEPTED_SPELLINGS = (
    *("1Gi", "1e9", "1E9", "1e+9", "1.5Gi", ".5Gi", "+1Gi", "1073741824", "0.001Ti", "1000000k"),
    *("16G", "32Ti", "1.e9", "1Mi"),
    *("1s", "1.5s", "1000ms", "90s", "1h30m", "1h1.5m", "2562047h", "1000000us", "1000000µs"),
    *("1000000000ns", "1m0s"),
)


def test_the_models_accept_exactly_the_quantities_and_durations_the_apiserver_accepts(
    crd: None, kube: Any, k8s_namespace: str
) -> None:
    """Issue 30 item 6: parse_quantity (kubernetes.utils.quantity) and parse_duration
    (durationpy) behind the pydantic models agree with the CRD's schema and CEL on every
    spelling, in and out of range."""
    specs = [PolicyBuilder().ram(sizeLimit=t).spec() for t in SIZE_SPELLINGS] + [
        PolicyBuilder().pvc(steps=None, every={"duration": t}).spec() for t in DURATION_SPELLINGS
    ]
    disagree, accepted = [], []
    for n, (text, spec) in enumerate(zip(SIZE_SPELLINGS + DURATION_SPELLINGS, specs, strict=True)):
        body = {
            "apiVersion": f"{api.GROUP}/{api.VERSION}",
            "kind": api.KIND,
            "metadata": {"name": f"spelling-{n}", "namespace": k8s_namespace},
            "spec": spec,
        }
        try:
            create_policy(kube, body)
            by_apiserver = True
        except ApiException as exc:
            assert exc.status == 422, exc
            by_apiserver = False
        try:
            parse_spec(spec)
            by_model = True
        except InvalidSpec:
            by_model = False
        if by_apiserver != by_model:
            disagree.append((text, by_apiserver, by_model))
        elif by_apiserver:
            accepted.append(text)
    assert disagree == [], "(spelling, apiserver accepts, model accepts)"
    assert sorted(accepted) == sorted(ACCEPTED_SPELLINGS)


def test_a_pending_pvc_is_degraded_and_said_in_ready_until_it_binds(
    k8s_cluster: LocalCluster, crd: None, kube: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    """A claim nothing has bound yet: the policy stays Ready (a WaitForFirstConsumer claim binds
    only once a pod mounts it, and the webhook refuses pods of a policy that is not Ready), its
    Ready message and Degraded=True PvcPending say so; binding it clears Degraded without
    touching the policy (the PVC watch)."""
    ns = k8s_namespace
    op = Operator(k8s_cluster, tmp_path, None)
    op.start("--dependency-retry", "600", "--no-bucket-check")
    try:
        create_pvc(kube, ns, "unbound", bound=False)
        create_policy(kube, PolicyBuilder("pending", ns).pvc("unbound").obj())
        policy = wait_ready(kube, ns, "pending")
        ready, degraded = condition(policy, k.READY), condition(policy, k.DEGRADED)
        assert ready is not None and "PVC is Pending" in ready["message"], ready
        assert degraded is not None, policy
        assert (degraded["status"], degraded["reason"]) == ("True", k.REASON_PVC_PENDING)
        assert "'unbound'" in degraded["message"], degraded
        create_pv_for(kube, ns, "unbound")

        def cleared() -> Obj | None:
            got = get_policy(kube, ns, "pending")
            d = condition(got, k.DEGRADED)
            return got if d is not None and d["status"] == "False" else None

        bound = wait_for("Degraded=False once the claim is Bound", cleared)
        ready = condition(bound, k.READY)
        assert ready is not None and ready["status"] == "True"
        assert "Pending" not in ready["message"], ready
        assert op.alive() and op.errors() == []
    finally:
        op.stop()


def test_a_policy_with_annotations_near_the_limit_is_still_tracked(
    operator: Operator, kube: Any, k8s_namespace: str
) -> None:
    """kopf used to copy labels and annotations into its last-handled-configuration annotation:
    a policy with 150 KiB of annotations could never be marked handled (the copy broke the
    256 KiB limit). The essence is now a digest: the policy is reconciled and updates work."""
    ns = k8s_namespace
    body = PolicyBuilder("annotated", ns).obj()
    body["metadata"]["annotations"] = {"example.com/notes": "n" * (150 * 1024)}
    create_policy(kube, body)
    wait_ready(kube, ns, "annotated", generation=1)
    patch_policy(kube, ns, "annotated", {"spec": {"tiers": {"ram": {"keep": 3}}}})
    policy = wait_ready(kube, ns, "annotated", generation=2)
    stored = policy["metadata"]["annotations"].get("strata.dev/last-handled-configuration", "")
    assert 0 < len(stored) < 512, stored
    assert operator.alive() and operator.errors() == []


def test_a_policy_name_longer_than_a_label_value_is_refused(
    kube: Any, k8s_namespace: str, crd: None
) -> None:
    with pytest.raises(ApiException) as err:
        create_policy(kube, PolicyBuilder("p" * 64, k8s_namespace).obj())
    assert err.value.status == 422
    assert "at most 63 characters" in json.loads(err.value.body)["message"]
    create_policy(kube, PolicyBuilder("p" * 63, k8s_namespace).obj())


def test_with_watch_secrets_a_created_secret_makes_its_policy_ready_at_once(
    k8s_cluster: LocalCluster, crd: None, kube: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    op = Operator(k8s_cluster, tmp_path, None)
    op.start("--dependency-retry", "600", "--no-bucket-check", "--watch-secrets")
    try:
        secret_ref = {"type": "SecretRef", "secretRef": {"name": "gcs-key"}}
        create_policy(kube, PolicyBuilder("keyed", ns).gcs(credentials=secret_ref).obj())
        missing = condition(wait_ready(kube, ns, "keyed", status="False"), k.READY)
        assert missing is not None and missing["reason"] == k.REASON_SECRET_NOT_FOUND
        client.CoreV1Api(kube).create_namespaced_secret(
            ns,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "gcs-key"},
                "stringData": {"key.json": "{}"},
            },
        )
        ready = condition(wait_ready(kube, ns, "keyed"), k.READY)
        assert ready is not None and ready["reason"] == k.REASON_RECONCILED
        assert op.alive() and op.errors() == []
    finally:
        op.stop()
