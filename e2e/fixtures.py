"""pytest fixtures of the local control plane (registered in the root conftest.py).

- ``k8s_binaries`` (session): the located `Binaries`. When some are missing the requesting test is
  skipped with the reason, unless ``STRATA_REQUIRE_E2E`` is set (CI sets it), then it fails.
- ``k8s_cluster`` (session): one started `LocalCluster` for the whole session, stopped at the end.
  Use ``.kubeconfig``, ``.server``, ``.ca_file``, ``.bin_dir``, ``.api_client()``,
  ``.kubectl(*args)``, ``.create_fake_node(name)``, ``.fail_pod(ns, name)``,
  ``.complete_pod(ns, name)``, ``.request(path)``.
- ``k8s_fake_node`` (session): the name of one Ready kwok node shared by the session
  (pin pods to it with ``nodeSelector: {kubernetes.io/hostname: <name>}``).
- ``api`` (function): a ``kubernetes.client.ApiClient`` of the cluster's admin, closed afterwards.
- ``k8s_namespace`` (function): a fresh namespace whose ``default`` ServiceAccount exists; deleted
  after the test (without waiting for it to terminate). When the test failed, the namespace's
  objects, Events and container logs are written first to ``e2e/results/failures/<namespace>/``
  (:func:`save_evidence`; ``STRATA_E2E_EVIDENCE`` overrides the directory), and the operator
  fixtures add the operator's log there.
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from e2e.cluster import (
    LOOPBACK_NO_PROXY,
    Binaries,
    BinariesMissing,
    ClusterError,
    LocalCluster,
)

REQUIRE_E2E_ENV = "STRATA_REQUIRE_E2E"
"""When set (to anything non-empty), missing control-plane binaries fail the e2e tests."""

EVIDENCE_ENV = "STRATA_E2E_EVIDENCE"
EVIDENCE_DIR = Path(__file__).resolve().parent / "results" / "failures"
"""Where a failed test's namespace is written (``e2e/results/failures/<namespace>/``)."""

_EVIDENCE_KINDS = "pods,services,configmaps,jobs,persistentvolumeclaims"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Remember each phase's outcome on the item (``item.strata_failed``), for teardowns."""
    report = yield
    if report.failed:
        item.strata_failed = True  # type: ignore[attr-defined]
    return report


def failed(request: pytest.FixtureRequest) -> bool:
    """Whether the requesting test's setup or call failed (read it in a fixture's teardown)."""
    return bool(getattr(request.node, "strata_failed", False))


def evidence_dir(namespace: str) -> Path:
    """The directory that keeps the evidence of a failed test in ``namespace`` (created)."""
    root = Path(os.environ.get(EVIDENCE_ENV) or EVIDENCE_DIR)
    d = root / namespace
    d.mkdir(parents=True, exist_ok=True)
    return d


def save_evidence(cluster: LocalCluster, namespace: str) -> Path:
    """Write ``namespace``'s objects (YAML), its Events and every container's log (current and
    previous) under :func:`evidence_dir`; returns the directory. Never raises: what cannot be
    read is written as the error that stopped it."""
    d = evidence_dir(namespace)

    def dump(name: str, *args: str) -> str:
        try:
            out = cluster.kubectl(*args, check=True)
        except (ClusterError, OSError) as err:
            out = f"could not read: {err}\n"
        (d / name).write_text(out)
        return out

    dump("objects.yaml", "get", _EVIDENCE_KINDS, "-n", namespace, "-o", "yaml")
    # A separate read: the CRD may not be installed in this test.
    dump("checkpointpolicies.yaml", "get", "checkpointpolicies", "-n", namespace, "-o", "yaml")
    # By creation: the operator's events.k8s.io/v1 Events leave the deprecated lastTimestamp unset.
    dump("events.txt", "get", "events", "-n", namespace, "--sort-by=.metadata.creationTimestamp")
    pods = dump("pods.txt", "get", "pods", "-n", namespace, "-o", "name")
    for pod in pods.split():
        if not pod.startswith("pod/"):
            continue
        name = pod.removeprefix("pod/")
        dump(f"{name}.log", "logs", "-n", namespace, pod, "--all-containers", "--prefix")
        dump(
            f"{name}.previous.log",
            "logs",
            "-n",
            namespace,
            pod,
            "--all-containers",
            "--prefix",
            "--previous",
        )
    return d


@pytest.fixture(scope="session")
def k8s_binaries() -> Binaries:
    """The control-plane binaries; skips (or fails under STRATA_REQUIRE_E2E) when absent."""
    try:
        return Binaries.locate()
    except BinariesMissing as err:
        if os.environ.get(REQUIRE_E2E_ENV):
            pytest.fail(f"{err} ({REQUIRE_E2E_ENV} is set, so the e2e tests must run)")
        pytest.skip(f"{err} (set {REQUIRE_E2E_ENV}=1 to turn this skip into a failure)")


@pytest.fixture(scope="session")
def k8s_cluster(
    k8s_binaries: Binaries,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalCluster]:
    """A running local control plane for the session (see `e2e.cluster.LocalCluster`)."""
    with pytest.MonkeyPatch.context() as mp:
        # Clients in the test process (kopf/aiohttp honour proxy variables) must reach loopback
        # directly.
        for key in ("NO_PROXY", "no_proxy"):
            current = os.environ.get(key)
            mp.setenv(key, f"{LOOPBACK_NO_PROXY},{current}" if current else LOOPBACK_NO_PROXY)
        cluster = LocalCluster(tmp_path_factory.mktemp("k8s"), k8s_binaries)
        try:
            seconds = cluster.start()
        except ClusterError as err:
            cluster.stop()
            pytest.fail(f"local control plane failed to start: {err}")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"local control plane ready in {seconds:.1f} s at {cluster.server} "
                f"(logs: {cluster.directory / 'logs'})"
            )
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="session")
def k8s_fake_node(k8s_cluster: LocalCluster) -> str:
    """Name of a Ready kwok-managed Node shared by the session."""
    name = "kwok-node-0"
    k8s_cluster.create_fake_node(name)
    return name


@pytest.fixture
def api(k8s_cluster: LocalCluster) -> Iterator[ApiClient]:
    """An admin ``ApiClient`` of the local cluster (the one fixture every e2e module uses)."""
    api_client = k8s_cluster.api_client()
    try:
        yield api_client
    finally:
        api_client.close()


def namespace_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{base or 't'}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def k8s_namespace(k8s_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (named after the test) ready for pods; deleted afterwards."""
    name = namespace_name(request.node.name)
    k8s_cluster.request(
        "/api/v1/namespaces",
        "POST",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    # Pods are refused until the controller-manager has created the `default` ServiceAccount.
    deadline = time.monotonic() + 60
    while True:
        try:
            k8s_cluster.request(f"/api/v1/namespaces/{name}/serviceaccounts/default")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    request.node.strata_namespace = name
    try:
        yield name
    finally:
        if failed(request):
            where = save_evidence(k8s_cluster, name)
            print(f"\nevidence of the failed test kept in {where}")
        try:
            k8s_cluster.request(f"/api/v1/namespaces/{name}", "DELETE")
        except urllib.error.HTTPError as err:
            if err.code != 404:  # the test may have deleted it itself
                raise
