"""Two real nodes on this machine, joined to one `LocalCluster`, whose pods reach each other.

Each node is a whole `RealNode`: its own containerd (root, state, socket), kubelet (name, port,
root and state directories, ``cgroupRoot``, client certificate ``system:node:<name>``) and CNI
bridge on a /24 of its own (`free_subnet`: disjoint from each other and from every route of the
machine, other harness instances' bridges included). Between them:

- routes: each node's pods get a route to the other node's pod subnet through their bridge
  gateway (`RealNode.route_pods_to`), and the kernel forwards between the two bridges only
  (``net.ipv4.conf.<bridge>.forwarding``; the machine-wide ``ip_forward`` stays as it is). No
  NAT: pods see each other's pod IPs. The iptables ``FORWARD`` policy must accept (checked at
  start: a DROP policy is reported as `NodeUnavailable` naming it, never changed);
- names: `PodDns` on both gateways is the kubelets' ``clusterDNS``, so the pod host names the peer
  tier uses (``<hostname>.<subdomain>.<namespace>.svc``) resolve to pod IPs; no other name
  resolves and nothing is forwarded to the machine's resolver.

Node names default to ``strata-peer-a``/``-b`` (not `e2e.cluster.REAL_NODE_NAME`), so a pair can
join a cluster that also runs the single `RealNode`. `stop()` stops both nodes and the DNS and
`leftovers()` lists what of either is still on the machine (empty after a clean stop).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from e2e.cluster import LocalCluster
from e2e.node.dns import PodDns
from e2e.node.harness import NodeUnavailable, RealNode, _routes

PAIR_NODE_NAMES: Final = ("strata-peer-a", "strata-peer-b")


def forward_policy_problem() -> str | None:
    """Why the iptables FORWARD chain would drop pod-to-pod traffic between bridges, or None."""
    try:
        out = subprocess.run(
            ["iptables", "-S", "FORWARD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # no iptables: nothing filters
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        if line.startswith("-P FORWARD") and line.split()[-1] != "ACCEPT":
            return (
                f"iptables FORWARD policy is {line.split()[-1]} (`{line}`): pods on two bridges "
                "cannot reach each other; the harness does not change the machine's firewall "
                "(run `iptables -P FORWARD ACCEPT` on a machine made for this)"
            )
    return None


class NodePair:
    """See the module docstring. ``start()`` returns the seconds until both Nodes are Ready."""

    def __init__(self, cluster: LocalCluster, names: tuple[str, str] = PAIR_NODE_NAMES) -> None:
        if names[0] == names[1]:
            raise ValueError(f"the two nodes need distinct names, got {names}")
        self.cluster = cluster
        self.directories = [Path(tempfile.mkdtemp(prefix="strata-pn-")) for _ in names]
        self.nodes = [
            RealNode(cluster, d, name=n) for d, n in zip(self.directories, names, strict=True)
        ]
        self.dns: PodDns | None = None
        self.timings: dict[str, float] = {}

    def start(self) -> float:
        begin = time.monotonic()
        problem = forward_policy_problem()
        if problem:
            raise NodeUnavailable(problem)
        try:
            for node in self.nodes:
                node.reserve_network()
            a, b = self.nodes
            assert a.subnet is not None and b.subnet is not None
            a.route_pods_to(b.subnet)
            b.route_pods_to(a.subnet)
            self.dns = PodDns(self.cluster, [n.gateway for n in self.nodes])
            self.dns.start()
            for node in self.nodes:
                node.cluster_dns = node.gateway
            self.timings["networks"] = time.monotonic() - begin
            for node in self.nodes:
                node.start()
                self.timings[f"{node.name} ready"] = time.monotonic() - begin
        except BaseException:
            self.stop()
            raise
        self.timings["both ready"] = time.monotonic() - begin
        return self.timings["both ready"]

    def import_images(self, archives: Mapping[str, Path]) -> dict[str, float]:
        """Import the OCI archives ``{image name: archive}`` into both nodes' containerd, the two
        nodes in parallel (each its own ``ctr`` processes); returns the seconds per
        ``"<node> <image>"``. Raises the first `NodeError` of either node."""

        def one(node: RealNode) -> dict[str, float]:
            return {f"{node.name} {n}": node.import_image(a) for n, a in archives.items()}

        out: dict[str, float] = {}
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            for seconds in pool.map(one, self.nodes):
                out.update(seconds)
        return out

    def stop(self) -> None:
        """Stop both nodes (each tried even when the other fails) and the DNS; the first error
        is raised at the end. Directories are removed when nothing of their node is left."""
        errors: list[BaseException] = []
        # Pods of both nodes first: a node's teardown removes the network namespaces made since
        # the pair reserved its networks, the other node's pods' included.
        for node in self.nodes:
            if node.kubelet is not None and node.kubelet.alive():
                try:
                    node.delete_pods()
                except BaseException as exc:
                    errors.append(exc)
        for node in self.nodes:
            try:
                node.stop()
            except BaseException as exc:
                errors.append(exc)
        if self.dns is not None:
            self.dns.stop()
        for node, d in zip(self.nodes, self.directories, strict=True):
            if not node.leftovers():
                shutil.rmtree(d, ignore_errors=True)
        if errors:
            raise errors[0]

    def leftovers(self) -> list[str]:
        """What of either node, their routes or the DNS is still on the machine."""
        left = [f"{n.name}: {item}" for n in self.nodes for item in n.leftovers()]
        subnets = [n.subnet for n in self.nodes if n.subnet is not None]
        left += [f"route {r}" for r in _routes() if any(r.overlaps(s) for s in subnets)]
        if self.dns is not None and self.dns.listening():
            left.append("pod DNS still listening")
        return left
