"""The operator as a local process whose report receiver the real node's pods can reach.

Pods on the node live in their own network namespaces on the node's CNI bridge: the machine's
loopback, where `e2e.operator_fixtures.OperatorProcess` listens, is not theirs. `NodeOperator`
binds the report receiver to the bridge gateway (the host's address on the bridge, an address of
this machine only), injects ``https://<gateway>:<port>`` as the report endpoint and puts the
gateway into the generated certificate's SANs, so the sidecars' reports travel over the bridge
and are verified against the operator's CA. The webhook and the metrics stay on loopback (the
apiserver and the tests reach them there).

Fixture ``node_operator`` (module): CRDs applied, the operator started for the module's
``real_node`` and stopped at the end (the webhook configuration deleted). It replaces
``operator_running`` in real-node test modules; both must not run in one module (one webhook
configuration, ``strata.dev``).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.node.harness import RealNode
from e2e.operator_fixtures import (
    OPERATOR_NAMESPACE,
    WEBHOOK_CONFIG,
    OperatorProcess,
    apply_crds,
    ensure_namespace,
)


class NodeOperator(OperatorProcess):
    """`OperatorProcess` with the report receiver on ``report_host`` (the node's gateway)."""

    def __init__(self, cluster: LocalCluster, workdir: Path, report_host: str) -> None:
        super().__init__(cluster, workdir)
        self.report_host = report_host

    @property
    def report_url(self) -> str:
        return f"https://{self.report_host}:{self.report_port}"

    def argv(self, extra: Sequence[str]) -> list[str]:
        base = [
            a for a in super().argv(()) if not a.startswith(("--report-listen=", "--report-url="))
        ]
        return [
            *base,
            f"--report-listen={self.report_host}",
            f"--report-url={self.report_url}",
            f"--tls-san={self.report_host}",
            *extra,
        ]

    def _tls_ok(self, port: int) -> bool:
        host = self.report_host if port == self.report_port else "127.0.0.1"
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with (
                socket.create_connection((host, port), timeout=2) as sock,
                context.wrap_socket(sock, server_hostname=host),
            ):
                return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def node_operator(
    k8s_cluster: LocalCluster,
    real_node: RealNode,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NodeOperator]:
    apply_crds(k8s_cluster)
    ensure_namespace(k8s_cluster, OPERATOR_NAMESPACE)
    op = NodeOperator(k8s_cluster, tmp_path_factory.mktemp("node-operator"), real_node.gateway)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        k8s_cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found"
        )
