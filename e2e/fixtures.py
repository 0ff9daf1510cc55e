"""pytest fixtures of the local control plane (registered in the root conftest.py).

- ``k8s_binaries`` (session): the located `Binaries`. When some are missing the requesting test is
  skipped with the reason, unless ``STRATA_REQUIRE_E2E`` is set (CI sets it), then it fails.
- ``k8s_cluster`` (session): one started `LocalCluster` for the whole session, stopped at the end.
  Use ``.kubeconfig``, ``.server``, ``.ca_file``, ``.bin_dir``, ``.api_client()``,
  ``.kubectl(*args)``, ``.create_fake_node(name)``, ``.fail_pod(ns, name)``,
  ``.complete_pod(ns, name)``, ``.request(path)``.
- ``k8s_fake_node`` (session): the name of one Ready kwok node shared by the session
  (pin pods to it with ``nodeSelector: {kubernetes.io/hostname: <name>}``).
- ``k8s_namespace`` (function): a fresh namespace whose ``default`` ServiceAccount exists; deleted
  after the test (without waiting for it to terminate).
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import uuid
from collections.abc import Iterator

import pytest

from e2e.cluster import (
    LOOPBACK_NO_PROXY,
    Binaries,
    BinariesMissing,
    ClusterError,
    LocalCluster,
)

REQUIRE_E2E_ENV = "STRATA_REQUIRE_E2E"
"""When set (to anything non-empty), missing control-plane binaries fail the e2e tests."""


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


def _namespace_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{base or 't'}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def k8s_namespace(k8s_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (named after the test) ready for pods; deleted afterwards."""
    name = _namespace_name(request.node.name)
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
    try:
        yield name
    finally:
        try:
            k8s_cluster.request(f"/api/v1/namespaces/{name}", "DELETE")
        except urllib.error.HTTPError as err:
            if err.code != 404:  # the test may have deleted it itself
                raise
