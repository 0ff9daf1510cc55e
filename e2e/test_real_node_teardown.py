"""The real node's teardown leaves nothing on the machine, checked from the outside.

`RealNode.leftovers` is the harness' own view; this test does not trust it alone. It starts a
node, runs a pod on it (a pause container with a ``medium: Memory`` emptyDir, i.e. a tmpfs, and a
disk emptyDir, so the kubelet makes pod cgroups, mounts, a network namespace and a veth on the
bridge), records what exists, stops the node and then looks at the machine directly: no process
whose command line names the node's directory or socket, no mount under the directory, no new
cgroup at the top of any cgroup hierarchy (the cgroup v1 controllers *and* the cgroup2 ``unified``
mount of a hybrid host, where the kubelet also makes its tree), no bridge, no veth, no network
namespace, no pod log directory or link, no Node object.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.fixtures import REQUIRE_E2E_ENV
from e2e.node.harness import (
    NETNS_DIR,
    NODE_SELECTOR,
    PAUSE_IMAGE,
    POD_LOG_LINKS,
    TOLERATION,
    NodeUnavailable,
    RealNode,
    missing_prerequisites,
)

pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(900)]


def cgroup_mounts() -> dict[str, str]:
    """Every cgroup (v1) and cgroup2 mount point of the machine -> its type."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2"):
            out[target] = fstype
    return out


def top_cgroups() -> set[str]:
    """``<mount>/<dir>`` for each cgroup directly under a hierarchy's root."""
    out: set[str] = set()
    for mount in cgroup_mounts():
        with contextlib.suppress(OSError):
            out |= {f"{mount}/{d.name}" for d in Path(mount).iterdir() if d.is_dir()}
    return out


def processes_naming(*needles: str) -> list[str]:
    found: list[str] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if any(n in cmd for n in needles):
                found.append(f"{proc.name}: {cmd[:160]}")
    return found


def mounts_under(directory: Path) -> list[str]:
    return [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(str(directory))
    ]


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def bridge_ports(bridge: str) -> list[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show", "master", bridge], capture_output=True, text=True
    ).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def test_teardown_leaves_nothing_behind(
    k8s_cluster: LocalCluster, request: pytest.FixtureRequest
) -> None:
    missing = missing_prerequisites(k8s_cluster.bin_dir)
    if missing:
        reason = "real node prerequisites missing: " + "; ".join(missing)
        if os.environ.get(REQUIRE_E2E_ENV):
            pytest.fail(reason)
        pytest.skip(reason)
    cgroups_before = top_cgroups()
    netns_before = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
    directory = Path(tempfile.mkdtemp(prefix="strata-node-"))
    node = RealNode(k8s_cluster, directory)
    try:
        node.start()
    except NodeUnavailable as exc:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(str(exc))
    stopped = False
    try:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "teardown-probe", "namespace": "default"},
            "spec": {
                "nodeSelector": NODE_SELECTOR,
                "tolerations": [TOLERATION],
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "pause",
                        "image": PAUSE_IMAGE,
                        "imagePullPolicy": "Never",
                        "volumeMounts": [
                            {"name": "ram", "mountPath": "/ram"},
                            {"name": "scratch", "mountPath": "/scratch"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "ram", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}},
                    {"name": "scratch", "emptyDir": {"sizeLimit": "8Mi"}},
                ],
            },
        }
        k8s_cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
        deadline = time.monotonic() + 180
        uid = ""
        while time.monotonic() < deadline:
            obj = json.loads(
                k8s_cluster.kubectl("-n", "default", "get", "pod", "teardown-probe", "-o", "json")
            )
            uid = obj["metadata"]["uid"]
            if (obj.get("status") or {}).get("phase") == "Running":
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"probe pod not Running: {obj.get('status')}")

        # What the node made while running, so that the checks below check something.
        new_cgroups = top_cgroups() - cgroups_before
        ours = {c for c in new_cgroups if c.endswith(f"/strata-{node.id}")}
        assert ours, f"no /strata-{node.id} cgroup in any hierarchy: {sorted(new_cgroups)}"
        unified = [m for m, t in cgroup_mounts().items() if t == "cgroup2"]
        pods_in = [m for m in unified if any(Path(m, f"strata-{node.id}").rglob("*pod*"))]
        mounted = mounts_under(directory)
        assert any(uid in m and m.endswith("/ram") for m in mounted), mounted
        veths = bridge_ports(node.bridge)
        assert veths, f"no veth on {node.bridge}"
        netns_made = (set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()) - netns_before
        assert netns_made
        bridge = node.bridge

        node.stop()
        stopped = True

        left: list[str] = []
        left += [f"process {p}" for p in processes_naming(str(directory))]
        left += [f"mount {m}" for m in mounts_under(directory)]
        # A new top-level cgroup that is ours, or one that belongs to no real node (another
        # helper's node may run on this machine: its cgroups are /strata-<its id>).
        left += [
            f"cgroup {c}"
            for c in sorted(top_cgroups() - cgroups_before)
            if c.endswith(f"/strata-{node.id}") or not c.rsplit("/", 1)[1].startswith("strata-")
        ]
        if link_exists(bridge):
            left.append(f"bridge {bridge}")
        left += [f"veth {v}" for v in veths if link_exists(v)]
        now = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
        left += [f"netns {n}" for n in netns_made & now]
        if POD_LOG_LINKS.is_dir():
            left += [
                f"log link {p}"
                for p in POD_LOG_LINKS.iterdir()
                if p.is_symlink() and os.readlink(p).startswith(str(directory))
            ]
        left += [f"pod logs {p}" for p in Path("/var/log/pods").glob(f"*{uid}*")]
        if k8s_cluster.kubectl("get", "node", node.name, "--ignore-not-found", check=False).strip():
            left.append(f"node {node.name}")
        left += [f"(harness) {x}" for x in node.leftovers()]
        assert not left, f"the real node left behind: {left}"
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"[real node] teardown clean: {len(ours)} hierarchies held /strata-{node.id} "
                f"(pod cgroups in cgroup2 mounts: {pods_in or 'none'}), {len(mounted)} mounts, "
                f"{len(veths)} veth, {len(netns_made)} netns removed"
            )
    finally:
        if not stopped:
            node.stop()
        k8s_cluster.kubectl(
            "-n",
            "default",
            "delete",
            "pod",
            "teardown-probe",
            "--ignore-not-found",
            "--grace-period=0",
            "--force",
            check=False,
        )
        shutil.rmtree(directory, ignore_errors=True)
