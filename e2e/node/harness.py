"""A real node joined to a `LocalCluster`: containerd + runc, a CNI bridge, a real kubelet.

Everything the node owns lives under one directory (containerd's ``root``, ``state`` and socket,
the kubelet's ``--root-dir``, pod logs, CNI configuration and IPAM state) plus three machine-wide
objects named after a per-node id: a Linux bridge ``sn<id>`` holding the gateway of a private /24
that overlaps no route of the machine, a cgroup ``/strata-<id>`` in every cgroup v1 hierarchy
(the kubelet's ``cgroupRoot``), and the network namespaces containerd creates for the pods.
`RealNode.stop` deletes the pods, stops the kubelet, removes every container task, stops
containerd and its shims, unmounts what is mounted under the directory, removes the new network
namespaces, the cgroups and the bridge: nothing of it is left on the machine.

Machine facts this is built on (no systemd, cgroup v1, root without CAP_SYS_RESOURCE):
containerd needs ``restrict_oom_score_adj = true`` (else every sandbox fails in runc with
``can't get final child's PID from pipe``), the kubelet needs ``failCgroupV1: false`` and a
non-loopback ``--node-ip`` (the bridge gateway), and the apiserver reaches the kubelet by that
InternalIP (`e2e.cluster.LocalCluster` passes ``--kubelet-preferred-address-types=InternalIP``),
so no name is ever resolved. The node is tainted ``strata.dev/real-node=true:NoSchedule`` so that
pods of other e2e tests (meant for kwok's fake nodes) never land on it; real-node pods tolerate it
(`TOLERATION`).

Errors: `NodeUnavailable` when a prerequisite is missing (tests skip, or fail under
``STRATA_REQUIRE_E2E``), `NodeError` when the node fails to come up (with the log tail).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Final

from e2e.cluster import REAL_NODE_NAME, Component, LocalCluster, loopback_env, write_kubeconfig

CNI_BIN_DIRS: Final = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
CNI_PLUGINS: Final = ("bridge", "host-local", "loopback")
TAINT_KEY: Final = "strata.dev/real-node"
TOLERATION: Final = {"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
"""Add to ``spec.tolerations`` of a pod meant for the real node."""
NODE_SELECTOR: Final = {"kubernetes.io/hostname": REAL_NODE_NAME}
PAUSE_IMAGE: Final = "strata.dev/pause:e2e"
NETNS_DIR: Final = Path("/var/run/netns")
POD_LOG_LINKS: Final = Path("/var/log/containers")
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")


class NodeError(RuntimeError):
    """The real node failed to start or to stop cleanly; the message holds the logs' tails."""


class NodeUnavailable(NodeError):
    """A prerequisite of the real node is missing on this machine (the message says which)."""


def cni_bin_dir() -> Path | None:
    for d in CNI_BIN_DIRS:
        if all((d / p).is_file() for p in CNI_PLUGINS):
            return d
    return None


def missing_prerequisites(bin_dir: Path) -> list[str]:
    """What this machine lacks to run a real node (empty when nothing); each item says how to
    get it."""
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root (containerd, mounts, cgroups and bridges need it)")
    for tool, pkg in (("containerd", "containerd"), ("ctr", "containerd"), ("runc", "runc")):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt-get install {pkg})")
    for tool in ("ip", "mount", "umount"):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (apt-get install iproute2 mount)")
    if cni_bin_dir() is None:
        missing.append(
            "CNI plugins bridge/host-local/loopback (apt-get install containernetworking-plugins)"
        )
    for b in ("kubelet", "pause"):
        if not (bin_dir / b).is_file():
            missing.append(f"{bin_dir / b} (make tools)")
    if not (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").is_file():
        missing.append("a cgroup hierarchy under /sys/fs/cgroup")
    return missing


def _routes() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    )
    nets: list[ipaddress.IPv4Network] = []
    for line in out.stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("broadcast", "local", "unreachable", "prohibit", "blackhole"):
            first = line.split()[1]
        if first == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(first, strict=False))
    return nets


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/16 that overlaps no route of the machine (other nodes' bridges
    included)."""
    taken = _routes()
    for third in range(0, 256):
        net = ipaddress.IPv4Network(f"10.200.{third}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NodeError("no free /24 in 10.200.0.0/16 for the pod bridge")


def _hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies (each a mount point under /sys/fs/cgroup), or the v2 root."""
    if (CGROUP_ROOT / "cgroup.controllers").is_file():
        return [CGROUP_ROOT]
    out: list[Path] = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        # cgroup2 too: the kubelet also makes its tree in a hybrid host's `unified` mount.
        if parts[2] in ("cgroup", "cgroup2") and parts[1].startswith(str(CGROUP_ROOT)):
            out.append(Path(parts[1]))
    return out


def _run(*argv: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class RealNode:
    """One real node (see the module docstring). ``start()`` returns the seconds until the Node is
    Ready; ``stop()`` leaves nothing behind. ``import_image(archive)`` loads an OCI archive into
    containerd's ``k8s.io`` namespace (pods then use ``imagePullPolicy: Never``)."""

    def __init__(
        self,
        cluster: LocalCluster,
        directory: Path,
        *,
        name: str = REAL_NODE_NAME,
        cluster_dns: str | None = None,
    ) -> None:
        """``name``: the Node's name (a node named otherwise than `REAL_NODE_NAME` gets a client
        certificate of its own, ``system:node:<name>``, signed by the cluster CA).
        ``cluster_dns``: the IP address pods of ``dnsPolicy: ClusterFirst`` use as their
        nameserver (the kubelet's ``clusterDNS``, domain ``cluster.local``); None: pods get an
        empty resolv.conf."""
        self.cluster = cluster
        self.id = uuid.uuid4().hex[:8]
        # Unix socket paths are limited to 108 bytes: keep the node's directory short.
        self.directory = directory.resolve()
        self.name = name
        self.cluster_dns = cluster_dns
        self.pod_routes: list[ipaddress.IPv4Network] = []
        """Networks (other nodes' pod subnets) the pods reach through the bridge gateway; see
        `route_pods_to`."""
        self.bridge = f"sn{self.id}"
        self.cgroup = f"/strata-{self.id}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self.containerd_sock = self.directory / "containerd.sock"
        self.kubelet_port = 0
        self.healthz_port = 0
        self.containerd: Component | None = None
        self.kubelet: Component | None = None
        self._netns_before: set[str] = set()
        self._log_links_existed = True
        self.timings: dict[str, float] = {}
        self.bin_dir = cluster.bin_dir

    # ------------------------------------------------------------------ paths

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    @property
    def pod_logs(self) -> Path:
        return self.directory / "pod-logs"

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 180.0) -> float:
        missing = missing_prerequisites(self.bin_dir)
        if missing:
            raise NodeUnavailable("real node prerequisites missing: " + "; ".join(missing))
        begin = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        try:
            if self.subnet is None:  # else `reserve_network` made it
                self._snapshot()
                self._network()
            self._cgroups()
            self._start_containerd(begin + timeout)
            self.timings["containerd"] = time.monotonic() - begin
            self.import_pause()
            self.timings["pause-image"] = time.monotonic() - begin
            self._start_kubelet(begin + timeout)
            self.timings["node-ready"] = time.monotonic() - begin
        except BaseException:
            self.stop()
            raise
        return self.timings["node-ready"]

    def reserve_network(self) -> str:
        """Create the node's bridge and CNI configuration now, before `start` (which then keeps
        them), and return the gateway address: for a control plane that must know it before it
        starts (a certificate naming it). `stop` removes the bridge either way."""
        if self.subnet is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._snapshot()
            try:
                self._network()
            except BaseException:
                self._remove_bridge()
                raise
        return self.gateway

    def _snapshot(self) -> None:
        """What exists before this node does (network namespaces, the pod log links' folder)."""
        self._netns_before = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
        self._log_links_existed = POD_LOG_LINKS.is_dir()

    def _network(self) -> None:
        self.subnet = free_subnet()
        self.gateway = str(self.subnet.network_address + 1)
        _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self._write_cni_conf()

    def route_pods_to(self, subnet: ipaddress.IPv4Network) -> None:
        """Give this node's pods a route to ``subnet`` (another node's pod subnet) through the
        bridge gateway, and let the kernel forward what arrives on this node's bridge (only on
        it: ``net.ipv4.conf.<bridge>.forwarding``, which goes away with the bridge; the
        machine-wide ``ip_forward`` is left alone). Call after `reserve_network` and before
        `start`: pods created afterwards get the route."""
        if self.subnet is None:
            raise NodeError(f"node {self.name}: route_pods_to needs reserve_network first")
        if subnet.overlaps(self.subnet):
            raise NodeError(f"node {self.name}: {subnet} overlaps the node's own {self.subnet}")
        if subnet not in self.pod_routes:
            self.pod_routes.append(subnet)
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/forwarding").write_text("1\n")
        self._write_cni_conf()

    def _write_cni_conf(self) -> None:
        assert self.subnet is not None
        cni_dir = self.directory / "cni"
        (cni_dir / "net.d").mkdir(parents=True, exist_ok=True)
        ipam: dict[str, Any] = {
            "type": "host-local",
            "ranges": [[{"subnet": str(self.subnet), "gateway": self.gateway}]],
            "dataDir": str(cni_dir / "ipam"),
        }
        if self.pod_routes:
            ipam["routes"] = [{"dst": str(n), "gw": self.gateway} for n in self.pod_routes]
        conf = {
            "cniVersion": "0.4.0",
            "name": f"strata-{self.id}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": ipam,
                }
            ],
        }
        (cni_dir / "net.d" / "10-strata.conflist").write_text(json.dumps(conf, indent=2))

    def _cgroups(self) -> None:
        for h in _hierarchies():
            d = h / self.cgroup.lstrip("/")
            d.mkdir(exist_ok=True)
            if (h / "cpuset.cpus").is_file():
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((h / f).read_text())

    def _start_containerd(self, deadline: float) -> None:
        cni_bin = cni_bin_dir()
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{self.directory / "containerd" / "root"}"
state = "{self.directory / "containerd" / "state"}"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{self.containerd_sock}"

[ttrpc]
  address = "{self.containerd_sock}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
  discard_unpacked_layers = false

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{cni_bin}"
  conf_dir = "{self.directory / "cni" / "net.d"}"
  max_conf_num = 1

[{cri}.registry]
  config_path = ""
"""
        cfg = self.directory / "containerd.toml"
        cfg.write_text(config)
        self.containerd = Component(
            "containerd",
            ["containerd", "--config", str(cfg), "--log-level", "warn"],
            self.logs / "containerd.log",
        )
        self.containerd.start(loopback_env(), die_with_parent=True)
        while not self._ctr_ok():
            if not self.containerd.alive():
                raise NodeError(f"containerd exited:\n{self.containerd.log_tail()}")
            if time.monotonic() > deadline:
                raise NodeError(f"containerd not serving in time:\n{self.containerd.log_tail()}")
            time.sleep(0.2)

    def ctr(self, *args: str, check: bool = True, timeout: float = 300.0) -> str:
        """Run ``ctr`` against this node's containerd in the ``k8s.io`` namespace; stdout."""
        return _run(
            "ctr",
            "--address",
            str(self.containerd_sock),
            "--namespace",
            "k8s.io",
            *args,
            check=check,
            timeout=timeout,
        ).stdout

    def _ctr_ok(self) -> bool:
        if not self.containerd_sock.exists():
            return False
        return (
            _run(
                "ctr", "--address", str(self.containerd_sock), "version", check=False, timeout=10
            ).returncode
            == 0
        )

    def import_image(self, archive: Path) -> float:
        """Load an OCI image archive (its ``io.containerd.image.name`` annotation names it);
        returns the seconds taken."""
        begin = time.monotonic()
        self.ctr("images", "import", str(archive))
        return time.monotonic() - begin

    def import_pause(self) -> None:
        from e2e.node.images import pause_image  # the pause image is built from bin_dir/pause

        self.import_image(pause_image(self.bin_dir))

    def _start_kubelet(self, deadline: float) -> None:
        from e2e.cluster import free_port

        c = self.cluster
        p = c.pki
        kubeconfig = write_kubeconfig(
            self.directory / "kubelet.kubeconfig", c.server, self._kubelet_pki(), "kubelet"
        )
        c.kubectl(
            "create",
            "clusterrolebinding",
            f"strata-real-node-{self.id}",
            "--clusterrole=system:node",
            f"--user=system:node:{self.name}",
        )
        self.kubelet_port = free_port()
        self.healthz_port = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup,
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            "address": self.gateway,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "x509": {"clientCAFile": str(p.ca_cert)},
                "webhook": {"enabled": False},
                "anonymous": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "podLogsDir": str(self.pod_logs),
            # The disk is shared with other work: never evict or garbage-collect images.
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "imageMinimumGCAge": "24h",
            # No cluster DNS: an empty resolv.conf in pods, so nothing is ever looked up.
            "resolvConf": "",
            "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
            "serializeImagePulls": False,
            "volumePluginDir": str(self.directory / "volume-plugins"),
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "maxPods": 30,
            "shutdownGracePeriod": "0s",
            "localStorageCapacityIsolation": True,
        }
        if self.cluster_dns is not None:
            config["clusterDNS"] = [self.cluster_dns]
            config["clusterDomain"] = "cluster.local"
        cfg = self.directory / "kubelet.yaml"
        cfg.write_text(json.dumps(config, indent=2))
        self.kubelet = Component(
            "kubelet",
            [
                str(self.bin_dir / "kubelet"),
                f"--config={cfg}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.directory / 'kubelet'}",
                f"--cert-dir={self.directory / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.gateway}",
                "--v=1",
            ],
            self.logs / "kubelet.log",
        )
        self.kubelet.start(loopback_env(), die_with_parent=True)
        while not self.ready():
            if not self.kubelet.alive():
                raise NodeError(f"kubelet exited:\n{self.kubelet.log_tail(40)}")
            if time.monotonic() > deadline:
                raise NodeError(f"node {self.name} not Ready in time:\n{self.kubelet.log_tail(40)}")
            time.sleep(0.5)

    def _kubelet_pki(self) -> Any:
        """The `e2e.pki.Pki` holding the kubelet's client certificate ``kubelet``: the cluster's
        for `REAL_NODE_NAME`, else one in the node's directory for ``system:node:<name>``."""
        if self.name == REAL_NODE_NAME:
            return self.cluster.pki
        from e2e.node.credentials import node_client_pki

        return node_client_pki(self.cluster.pki, self.directory / "pki", self.name)

    def ready(self) -> bool:
        try:
            node = self.cluster.request(f"/api/v1/nodes/{self.name}")
        except OSError:
            return False
        conds = (node.get("status") or {}).get("conditions") or []
        return any(cd["type"] == "Ready" and cd["status"] == "True" for cd in conds)

    # ------------------------------------------------------------------ teardown

    def _pods_on_node(self) -> list[dict[str, Any]]:
        try:
            obj = self.cluster.request(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.name}")
        except OSError:
            return []
        items: list[dict[str, Any]] = obj.get("items") or []
        return items

    def delete_pods(self, timeout: float = 90.0) -> None:
        """Delete every pod bound to this node (grace 5 s) and wait until the kubelet removed
        them; what is left after ``timeout`` is force-deleted."""
        pods = self._pods_on_node()
        for pod in pods:
            m = pod["metadata"]
            with contextlib.suppress(OSError):
                self.cluster.request(
                    f"/api/v1/namespaces/{m['namespace']}/pods/{m['name']}",
                    "DELETE",
                    {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 5},
                )
        deadline = time.monotonic() + timeout
        while self._pods_on_node() and time.monotonic() < deadline:
            if self.kubelet is None or not self.kubelet.alive():
                break
            time.sleep(0.5)
        for pod in self._pods_on_node():
            m = pod["metadata"]
            with contextlib.suppress(OSError):
                self.cluster.request(
                    f"/api/v1/namespaces/{m['namespace']}/pods/{m['name']}",
                    "DELETE",
                    {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
                )

    def stop(self) -> None:
        """Tear everything down (see the module docstring); errors are collected and raised
        as one `NodeError` at the end, after every step was tried."""
        errors: list[str] = []

        def step(what: str, fn: Any) -> None:
            try:
                fn()
            except Exception as exc:  # keep tearing down
                errors.append(f"{what}: {exc}")

        if self.kubelet is not None and self.kubelet.alive() and self.containerd is not None:
            step("deleting pods", self.delete_pods)
        if self.kubelet is not None:
            step(
                "stopping the kubelet",
                lambda: self.kubelet.stop(grace=15) if self.kubelet else None,
            )
        if self.containerd is not None and self.containerd.alive():
            step("removing containers", self._remove_containers)
        if self.containerd is not None:
            step(
                "stopping containerd",
                lambda: self.containerd.stop(grace=15) if self.containerd else None,
            )
        step("killing shims", self._kill_shims)
        step("unmounting", self._unmount)
        step("removing netns", self._remove_netns)
        step("removing cgroups", self._remove_cgroups)
        step("removing the bridge", self._remove_bridge)
        step("removing pod log links", self._remove_log_links)
        with contextlib.suppress(OSError):
            self.cluster.kubectl(
                "delete",
                "clusterrolebinding",
                f"strata-real-node-{self.id}",
                "--ignore-not-found",
                check=False,
            )
            self.cluster.kubectl("delete", "node", self.name, "--ignore-not-found", check=False)
        if errors:
            raise NodeError("real node teardown incomplete: " + "; ".join(errors))

    def _remove_containers(self) -> None:
        for line in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", line, check=False)
        time.sleep(0.5)
        for line in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "delete", "-f", line, check=False)
        for line in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "delete", line, check=False)

    def _kill_shims(self) -> None:
        """containerd-shim processes started by this containerd (they outlive it by design)."""
        sock = str(self.containerd_sock)
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and b"containerd-shim" in cmd[0] and sock.encode() in cmd:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)

    def _mounts_under(self, root: Path) -> list[str]:
        out: list[str] = []
        for line in Path("/proc/self/mounts").read_text().splitlines():
            target = line.split()[1].replace("\\040", " ")
            if target == str(root) or target.startswith(str(root) + "/"):
                out.append(target)
        return out

    def _unmount(self) -> None:
        for _ in range(5):
            targets = self._mounts_under(self.directory)
            if not targets:
                return
            for t in sorted(targets, key=len, reverse=True):
                _run("umount", "-l", t, check=False)
        left = self._mounts_under(self.directory)
        if left:
            raise NodeError(f"still mounted: {left}")

    def _remove_netns(self) -> None:
        # Only containerd makes them: a node that never started it owns none.
        if not NETNS_DIR.is_dir() or self.containerd is None:
            return
        for name in set(os.listdir(NETNS_DIR)) - self._netns_before:
            if name.startswith("cni-"):
                _run("umount", "-l", str(NETNS_DIR / name), check=False)
                with contextlib.suppress(OSError):
                    (NETNS_DIR / name).unlink()

    def _remove_cgroups(self) -> None:
        for h in _hierarchies():
            top = h / self.cgroup.lstrip("/")
            if not top.is_dir():
                continue
            dirs = sorted(
                (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            )
            for d in [*dirs, top]:
                for _ in range(20):
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        # Processes still exiting: move stragglers out and retry.
                        with contextlib.suppress(OSError):
                            for pid in (d / "cgroup.procs").read_text().split():
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(int(pid), signal.SIGKILL)
                        time.sleep(0.2)
                else:
                    raise NodeError(f"cgroup {d} could not be removed")

    def _remove_bridge(self) -> None:
        if _run("ip", "link", "show", self.bridge, check=False).returncode == 0:
            _run("ip", "link", "delete", self.bridge)

    def _remove_log_links(self) -> None:
        if not POD_LOG_LINKS.is_dir():
            return
        for link in POD_LOG_LINKS.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(str(self.directory)):
                    link.unlink()
        if not self._log_links_existed:
            with contextlib.suppress(OSError):
                POD_LOG_LINKS.rmdir()  # the kubelet made it; only when empty

    def leftovers(self) -> list[str]:
        """What of this node still exists on the machine (empty after a clean `stop`)."""
        left: list[str] = []
        if _run("ip", "link", "show", self.bridge, check=False).returncode == 0:
            left.append(f"bridge {self.bridge}")
        for h in _hierarchies():
            if (h / self.cgroup.lstrip("/")).exists():
                left.append(f"cgroup {h}{self.cgroup}")
        left += [f"mount {m}" for m in self._mounts_under(self.directory)]
        for c in (self.containerd, self.kubelet):
            if c is not None and c.alive():
                left.append(f"process {c.name}")
        sock = str(self.containerd_sock).encode()
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    cmd = (proc / "cmdline").read_bytes().split(b"\0")
                    if sock in cmd:
                        left.append(f"process {proc.name} {cmd[0].decode(errors='replace')}")
        if NETNS_DIR.is_dir():
            left += [f"netns {n}" for n in set(os.listdir(NETNS_DIR)) - self._netns_before]
        return left
