"""The Strata operator as a real subprocess against the local control plane (pytest fixtures).

- ``strata_operator`` (module): CRDs applied, the operator started with its own generated TLS
  (``python -m strata_operator``: kopf, the webhook on a free port, the report receiver, metrics)
  and ready: the MutatingWebhookConfiguration carries the operator's CA and the ports answer.
  Tests may stop, restart (new certificate) or reconfigure it; the fixture leaves it running with
  its default flags for the next test and deletes the webhook configuration at the end.
- ``workload_crds`` (session): the JobSet and PyTorchJob CRDs from the controllers' sources that
  ``e2e/build-tools.sh`` built (``<bin_dir>/workloads/``, see `e2e.workloads`); without that build,
  the PyTorchJob CRD from the ``github.com/kubeflow/training-operator`` Go module (downloaded at
  test time, not committed) and a minimal JobSet CRD (``e2e/testdata/jobset-crd.yaml``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import REPO_ROOT, LocalCluster, free_port, loopback_env
from e2e.fixtures import evidence_dir, failed, namespace_name
from e2e.workloads import JOBSET_CRD, PYTORCHJOB_CRD, apply_crd, crd_file

WEBHOOK_CONFIG = "strata.dev"
OPERATOR_NAMESPACE = "strata-system"
TRAINING_OPERATOR_MODULE = "github.com/kubeflow/training-operator@v1.8.1"
JOBSET_TEST_CRD = REPO_ROOT / "e2e" / "testdata" / "jobset-crd.yaml"


class OperatorProcess:
    """One ``python -m strata_operator`` process; ports fixed for its lifetime across restarts."""

    def __init__(self, cluster: LocalCluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.webhook_port = free_port()
        self.report_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "operator.log"
        self.starts = 0
        self.args: tuple[str, ...] = ()

    @property
    def tls_dir(self) -> Path:
        return self.workdir / "tls"

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.crt"

    @property
    def report_url(self) -> str:
        return f"https://127.0.0.1:{self.report_port}"

    def argv(self, extra: Sequence[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "strata_operator",
            f"--kubeconfig={self.cluster.kubeconfig}",
            "--no-bucket-check",
            f"--webhook-port={self.webhook_port}",
            "--webhook-listen=127.0.0.1",
            "--webhook-host=127.0.0.1",
            f"--report-port={self.report_port}",
            "--report-listen=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            "--metrics-listen=127.0.0.1",
            f"--operator-namespace={OPERATOR_NAMESPACE}",
            f"--tls-workdir={self.tls_dir}",
            f"--webhook-config-name={WEBHOOK_CONFIG}",
            "--sidecar-image=strata:e2e",
            *extra,
        ]

    def start(self, extra: Sequence[str] = (), timeout: float = 60.0) -> float:
        """Start (generating a new CA and certificate) and wait until ready; returns seconds."""
        if self.alive():
            raise RuntimeError("operator already running")
        begin = time.monotonic()
        self.args = tuple(extra)
        self.starts += 1
        shutil.rmtree(self.tls_dir, ignore_errors=True)
        logf = self.log.open("ab")
        logf.write(f"\n===== start #{self.starts}: {' '.join(extra)}\n".encode())
        logf.flush()
        self.proc = subprocess.Popen(
            self.argv(extra),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env={**loopback_env(), "PYTHONUNBUFFERED": "1"},
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        logf.close()
        self.wait_ready(timeout)
        return time.monotonic() - begin

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace`` s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        code = self.proc.returncode
        self.proc = None
        return code

    def restart(self, extra: Sequence[str] | None = None) -> float:
        self.stop()
        return self.start(self.args if extra is None else extra)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ca_bundle_in_cluster(self) -> bytes | None:
        try:
            obj = self.cluster.request(
                f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{WEBHOOK_CONFIG}"
            )
        except OSError:
            return None
        hooks = obj.get("webhooks") or []
        if not hooks:
            return None
        return base64.b64decode(hooks[0]["clientConfig"].get("caBundle", ""))

    def configured(self) -> bool:
        """The cluster's webhook configuration points at this process with its CA."""
        try:
            obj = self.cluster.request(
                f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{WEBHOOK_CONFIG}"
            )
        except OSError:
            return False
        hooks = obj.get("webhooks") or []
        return bool(hooks) and all(
            f":{self.webhook_port}/" in h["clientConfig"].get("url", "")
            and base64.b64decode(h["clientConfig"].get("caBundle", "")) == self.ca_file.read_bytes()
            for h in hooks
        )

    def _tls_ok(self, port: int) -> bool:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=2) as sock,
                context.wrap_socket(sock, server_hostname="127.0.0.1"),
            ):
                return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the configuration holds this process' CA and both HTTPS ports serve it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"operator exited; log {self.log}:\n{self.log_tail()}")
            if (
                self.ca_file.is_file()
                and self.configured()
                and self._tls_ok(self.webhook_port)
                and self._tls_ok(self.report_port)
            ):
                return
            time.sleep(0.2)
        raise RuntimeError(f"operator not ready in {timeout} s; log {self.log}:\n{self.log_tail()}")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Current samples of the operator's /metrics: ``{(name, sorted labels): value}``."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def wait_established(cluster: LocalCluster, crd: str, timeout: float = 60.0) -> None:
    """Until the CRD's Established condition is True (``kubectl wait`` races a fresh CRD)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = cluster.request(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        time.sleep(0.2)
    raise RuntimeError(f"CRD {crd} not Established after {timeout} s")


def apply_crds(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
    wait_established(cluster, "checkpointpolicies.strata.dev")


def ensure_namespace(cluster: LocalCluster, name: str) -> None:
    try:
        cluster.request(
            "/api/v1/namespaces",
            "POST",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
    except OSError as exc:
        if "409" not in str(exc) and "AlreadyExists" not in str(exc):
            raise


@pytest.fixture(scope="module")
def strata_operator(
    k8s_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The running operator (see the module docstring). Module-scoped: its webhook configuration
    matches every labelled pod in the cluster, so it must not outlive the tests that use it
    (test_helm.py runs its own operator from the chart and asserts what *that* one injected)."""
    apply_crds(k8s_cluster)
    ensure_namespace(k8s_cluster, OPERATOR_NAMESPACE)
    op = OperatorProcess(k8s_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    try:
        yield op
    finally:
        op.stop()
        k8s_cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found"
        )


def _fresh(op: OperatorProcess) -> None:
    # Restart when stopped, started with other flags, or when another operator of the session
    # (e.g. e2e/test_operator.py's) rewrote the shared webhook configuration.
    if not op.alive() or op.args or not op.configured():
        op.stop()
        op.start()


@pytest.fixture
def operator_running(
    strata_operator: OperatorProcess, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    """The operator, (re)started with default flags when a test stopped or changed it. When the
    test failed, its log goes with the namespace's evidence (``e2e.fixtures.save_evidence``)."""
    _fresh(strata_operator)
    yield strata_operator
    if failed(request):
        keep_operator_log(strata_operator, request)
    _fresh(strata_operator)


def keep_operator_log(op: OperatorProcess, request: pytest.FixtureRequest) -> None:
    """Copy the operator's log next to the failed test's namespace evidence (or under the
    test's own name when it used no namespace)."""
    where = str(getattr(request.node, "strata_namespace", "") or namespace_name(request.node.name))
    if op.log.exists():
        shutil.copyfile(op.log, evidence_dir(where) / "operator.log")


def _go_module_dir(module: str) -> Path:
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("go is not on PATH; it fetches the PyTorchJob CRD's module")
    proc = subprocess.run(
        [go, "mod", "download", "-json", module],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        cwd="/",
    )
    info: dict[str, Any] = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {module} failed: {info.get('Error') or proc.stderr}")
    return Path(info["Dir"])


@pytest.fixture(scope="session")
def workload_crds(k8s_cluster: LocalCluster) -> dict[str, str]:
    """Install the PyTorchJob and JobSet CRDs (built sources first, see the module docstring)."""
    sources: dict[str, str] = {}
    for name in (PYTORCHJOB_CRD, JOBSET_CRD):
        built = crd_file(k8s_cluster.bin_dir, name)
        if built is not None:
            apply_crd(k8s_cluster, built, name)
            sources[name] = f"{built} (built sources)"
    if PYTORCHJOB_CRD not in sources:
        try:
            module_dir = _go_module_dir(TRAINING_OPERATOR_MODULE)
            crd = module_dir / "manifests" / "base" / "crds" / "kubeflow.org_pytorchjobs.yaml"
            k8s_cluster.kubectl("apply", "--server-side", "-f", str(crd))
            sources[PYTORCHJOB_CRD] = f"{TRAINING_OPERATOR_MODULE} ({crd.name})"
        except RuntimeError as exc:
            pytest.skip(f"PyTorchJob CRD unavailable: {exc}")
    if JOBSET_CRD not in sources:
        k8s_cluster.kubectl("apply", "--server-side", "-f", str(JOBSET_TEST_CRD))
        sources[JOBSET_CRD] = f"{JOBSET_TEST_CRD.relative_to(REPO_ROOT)} (minimal)"
    for name in sources:
        wait_established(k8s_cluster, name)
    return sources
