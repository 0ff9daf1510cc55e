"""Strata installed the way users install it, on a control plane and a real node of its own.

`OperatorPodStack.start()` brings up, in this order:

1. the real node's bridge (`RealNode.reserve_network`), so that its gateway address is known;
2. a `LocalCluster` whose apiserver's certificate also names the gateway and which runs with
   ``--enable-aggregator-routing=true``: with no kube-proxy it resolves the webhook's Service to
   a Ready endpoint (the operator pod's IP on the bridge) itself, as the HA test's cluster does;
3. a `TcpRelay` on ``<gateway>:<apiserver port>`` to the apiserver on loopback: the operator pod's
   way to the API (``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``, set through the
   chart's ``operator.extraEnv``: what a cluster without kube-proxy sets);
4. the real node (kubelet, containerd), Strata's sidecar, trainer and operator images imported;
5. ``helm install`` of ``charts/strata`` into ``strata-system`` with the operator image built from
   ``operator/Dockerfile``, pinned to the real node (``nodeSelector``/``tolerations``), and waits
   until the operator pod is Ready (its webhook listening), leads (the Lease and the ``leader``
   role label the reports Service selects) and its webhook configuration has a caBundle.

There is no cluster DNS either: the sidecars' report URL names the reports Service
(``https://strata-reports.strata-system.svc:8444``, the chart's default), so pods meant to
report carry `host_aliases()` (the kubelet writes them into the pod's ``/etc/hosts``): that name
-> the operator pod's IP, i.e. the harness plays cluster DNS plus the Service's routing to its one
endpoint. Certificates are checked as in a cluster (the operator's names the Service).

Traffic stays on the machine: loopback and the bridge. `stop()` uninstalls the release, stops
the node, the relay and the control plane, and removes the directories; `leftovers()` lists what
of the node is still on the machine (empty after a clean stop).

Errors: `e2e.node.harness.NodeUnavailable` when a prerequisite is missing, `StackError` (with
the operator's log tail) when the operator does not come up.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from e2e.cluster import REPO_ROOT, Binaries, LocalCluster, loopback_env
from e2e.node.harness import NODE_SELECTOR, TOLERATION, RealNode
from e2e.node.images import BuiltImage
from e2e.node.relay import TcpRelay

CHART: Final = REPO_ROOT / "charts" / "strata"
RELEASE: Final = "strata"
NAMESPACE: Final = "strata-system"
OPERATOR_IMAGE: Final = "strata.dev/operator:e2e"
SIDECAR_IMAGE: Final = "strata.dev/sidecar:e2e"
TRAINER_IMAGE: Final = "strata.dev/trainer:e2e"
STACK_IMAGES: Final = (SIDECAR_IMAGE, TRAINER_IMAGE, OPERATOR_IMAGE)
OPERATOR_SELECTOR: Final = "app.kubernetes.io/instance=strata,app.kubernetes.io/component=operator"
REPORTS_HOST: Final = f"{RELEASE}-reports.{NAMESPACE}.svc"
"""The host of the report URL the chart gives the operator (its reports Service)."""
WEBHOOK_CONFIG: Final = f"{RELEASE}.strata.dev"
ROLE_LABEL: Final = "strata.dev/operator-role"


class StackError(RuntimeError):
    """The chart-installed operator did not come up; the message holds its state and log."""


def _repo_image(name: str) -> dict[str, str]:
    repository, _, tag = name.rpartition(":")
    return {"repository": repository, "tag": tag}


class OperatorPodStack:
    """See the module docstring. ``directory``: where the control plane and Helm keep their
    files (the node's own directory is a short one under /tmp: socket paths are limited)."""

    def __init__(
        self,
        directory: Path,
        images: Mapping[str, BuiltImage],
        binaries: Binaries | None = None,
        log: Callable[[str], None] = lambda _msg: None,
    ) -> None:
        self.directory = directory.resolve()
        self.images = images
        self.log = log
        self.cluster = LocalCluster(
            self.directory / "k8s",
            binaries,
            extra_args={"kube-apiserver": ["--enable-aggregator-routing=true"]},
        )
        self.node_dir = Path(tempfile.mkdtemp(prefix="strata-node-"))
        self.node = RealNode(self.cluster, self.node_dir)
        self.relay: TcpRelay | None = None
        self.installed = False
        self.operator_pod: dict[str, Any] = {}
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.cluster.kubectl(*args, "-o", "json"))

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        home = self.directory / "helm"
        env = {
            **loopback_env(),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        cmd = [str(self.cluster.bin_dir / "helm"), *args, f"--kubeconfig={self.cluster.kubeconfig}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if check and proc.returncode != 0:
            raise StackError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def values(self, relay_port: int) -> dict[str, Any]:
        """The chart values of this install (everything else is the chart's default)."""
        return {
            "image": {**_repo_image(OPERATOR_IMAGE), "pullPolicy": "Never"},
            "sidecar": {"image": _repo_image(SIDECAR_IMAGE)},
            "nodeSelector": dict(NODE_SELECTOR),
            "tolerations": [dict(TOLERATION)],
            "operator": {
                # No kube-proxy: the `kubernetes` ClusterIP leads nowhere; the relay does.
                "extraEnv": [
                    {"name": "KUBERNETES_SERVICE_HOST", "value": self.node.gateway},
                    {"name": "KUBERNETES_SERVICE_PORT", "value": str(relay_port)},
                ],
            },
        }

    @property
    def operator_ip(self) -> str:
        return str(self.operator_pod["status"]["podIP"])

    def host_aliases(self) -> list[dict[str, Any]]:
        """``spec.hostAliases`` for a pod whose sidecar reports: the reports Service's name ->
        the operator pod's IP (the harness's stand-in for cluster DNS and the Service)."""
        return [{"ip": self.operator_ip, "hostnames": [REPORTS_HOST]}]

    def create_namespace(self, name: str, timeout: float = 60.0) -> None:
        """Create namespace ``name`` and wait for its ``default`` ServiceAccount (pods are
        refused until the controller-manager made it)."""
        self.cluster.kubectl("create", "namespace", name)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.cluster.request(f"/api/v1/namespaces/{name}/serviceaccounts/default")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def operator_log(self, previous: bool = False) -> str:
        name = (self.operator_pod.get("metadata") or {}).get("name")
        if not name:
            return "(no operator pod)"
        args = ["-n", NAMESPACE, "logs", name, "-c", "operator", "--tail=60"]
        if previous:
            args.append("--previous")
        return self.cluster.kubectl(*args, check=False)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bring everything up (see the module docstring); on failure what was started is
        stopped again before the error propagates."""
        begin = time.monotonic()
        try:
            gateway = self.node.reserve_network()
            self.cluster.extra_serving_ips = (gateway,)
            self.log(f"control plane (its certificate also names the bridge gateway {gateway})")
            self.cluster.start()
            self.timings["control plane"] = time.monotonic() - begin
            api_port = urlsplit(self.cluster.server).port
            assert api_port is not None
            self.relay = TcpRelay(gateway, "127.0.0.1", api_port, listen_port=api_port)
            self.relay.start()
            self.log(f"real node: containerd, kubelet (relay {gateway}:{api_port} -> apiserver)")
            self.node.start()
            self.timings["node ready"] = time.monotonic() - begin
            self.log(f"importing {', '.join(STACK_IMAGES)}")
            for name in STACK_IMAGES:
                self.node.import_image(self.images[name].archive)
            self.timings["images imported"] = time.monotonic() - begin
            self.log(f"helm install {RELEASE} {CHART.relative_to(REPO_ROOT)} -n {NAMESPACE}")
            self.install(self.relay.listen_port)
            self.timings["operator ready"] = time.monotonic() - begin
        except BaseException:
            self.stop()
            raise

    def install(self, relay_port: int) -> None:
        values = self.directory / "values.json"
        values.write_text(json.dumps(self.values(relay_port), indent=2))
        self.helm(
            "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
            "-f", str(values),
        )  # fmt: skip
        self.installed = True
        self.operator_pod = self.wait_operator()

    def wait_operator(self, timeout: float = 300.0) -> dict[str, Any]:
        """Wait until the operator pod is Ready, labelled leader, and the webhook configuration
        carries its CA; returns the pod object."""
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] = {}
        while time.monotonic() < deadline:
            pods = self.kubectl_json("-n", NAMESPACE, "get", "pods", "-l", OPERATOR_SELECTOR)
            items = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
            if len(items) == 1:
                pod = items[0]
                self.operator_pod = pod
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in (pod.get("status") or {}).get("conditions") or []
                )
                leader = pod["metadata"].get("labels", {}).get(ROLE_LABEL) == "leader"
                if ready and leader and self._ca_bundle():
                    return pod
            time.sleep(1)
        raise StackError(
            f"the chart's operator pod is not Ready and leading after {timeout:.0f} s: "
            f"{json.dumps((pod or {}).get('status'), indent=1)}\nlog:\n{self.operator_log()}"
        )

    def _ca_bundle(self) -> bool:
        out = self.cluster.kubectl(
            "get", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, "-o", "json", check=False
        )
        with contextlib.suppress(ValueError):
            hooks = json.loads(out).get("webhooks") or []
            return bool(hooks) and all(h["clientConfig"].get("caBundle") for h in hooks)
        return False

    def stop(self) -> None:
        """Uninstall the release, stop the node, the relay and the control plane (each tried
        even when an earlier one fails; the first error is raised at the end)."""
        errors: list[BaseException] = []
        if self.installed:
            try:
                self.helm("uninstall", RELEASE, "--namespace", NAMESPACE, check=False)
            except BaseException as exc:
                errors.append(exc)
            self.installed = False
        for step in (
            self.node.stop,
            self._stop_relay,
            self.cluster.stop,
        ):
            try:
                step()
            except BaseException as exc:
                errors.append(exc)
        if not self.node.leftovers():
            shutil.rmtree(self.node_dir, ignore_errors=True)
        if errors:
            raise errors[0]

    def _stop_relay(self) -> None:
        if self.relay is not None:
            self.relay.stop()

    def leftovers(self) -> list[str]:
        return self.node.leftovers()
