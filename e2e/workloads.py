"""The real workload controllers on the local control plane: the JobSet controller
(``sigs.k8s.io/jobset``) and the PyTorchJob controller (``github.com/kubeflow/training-operator``,
``cmd/training-operator.v1``), both built by ``e2e/build-tools.sh`` into the tool cache, with
their CRDs and webhook manifests copied from the built sources into ``<bin_dir>/workloads/``.

Each controller runs as its own process against the local apiserver (admin kubeconfig, leader
election off, metrics off, health probes on a free loopback port) and serves its own admission
webhooks, registered with a ``url`` clientConfig on 127.0.0.1 (there is no Service network):

* JobSet: the mutating (JobSet defaulting, pod) and validating (JobSet, pod) webhooks of
  ``config/components/webhook`` with its kustomize patches (the pod webhooks select pods labelled
  ``jobset.sigs.k8s.io/jobset-name``), internal certificate management off, and a serving
  certificate for 127.0.0.1 generated here (``webhook.certDir`` of its configuration file).
* training-operator: only the PyTorchJob scheme (``--enable-scheme=pytorchjob``); its certificate
  rotator (open-policy-agent/cert-controller, always on in v1.8) reads the Secret
  ``training-operator-webhook-cert`` in ``MY_POD_NAMESPACE`` and injects its CA into the
  ValidatingWebhookConfiguration ``validator.training-operator.kubeflow.org``; both are created
  here beforehand, the Secret holding a CA and a certificate valid for the service DNS name the
  rotator checks *and* 127.0.0.1, so the rotator keeps it. Standing in for the kubelet's Secret
  volume, the harness writes the files where the webhook server reads them
  (``$TMPDIR/k8s-webhook-server/serving-certs``, TMPDIR set to the controller's work directory)
  and, when absent, ``tls.crt`` into ``/tmp/k8s-webhook-server/serving-certs``, the directory the
  rotator polls before it reports ready (hard-coded in v1.8.1; removed again at stop).

Errors: `e2e.cluster.BinariesMissing` when a controller was not built (the message says how to
build it), ``RuntimeError`` with the controller's log tail when it does not become ready.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import ipaddress
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from e2e.cluster import BinariesMissing, Component, LocalCluster, free_port

JOBSET_CRD = "jobsets.jobset.x-k8s.io"
PYTORCHJOB_CRD = "pytorchjobs.kubeflow.org"
JOBSET_WEBHOOK_PREFIX = "strata-e2e-jobset"
TRAINING_OPERATOR_VWC = "validator.training-operator.kubeflow.org"
TRAINING_OPERATOR_SECRET = "training-operator-webhook-cert"
TRAINING_OPERATOR_SERVICE = "training-operator"
TRAINING_OPERATOR_NAMESPACE = "kubeflow"
TRAINING_OPERATOR_CA = "training-operator-ca"
ROTATOR_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
"""Where training-operator v1.8.1's rotator waits for ``tls.crt`` (its pkg/cert ``certDir``)."""
"""The rotator's ``CAName`` (pkg/cert of training-operator v1.8.1)."""
BUILD_HINT = (
    "run `make tools` (or `bash e2e/build-tools.sh --workloads-only` for these two only); the "
    "JobSet controller builds from STRATA_JOBSET_ARCHIVE (default ../shared/vendor/"
    "jobset-v0.9.1.tar.gz next to the repository) or the module sigs.k8s.io/jobset@v0.9.1"
)


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class WorkloadController:
    """A built controller binary and the directory of its manifests (``crds/``, ``webhook/``)."""

    name: str
    binary: Path
    files: Path

    @classmethod
    def locate(cls, bin_dir: Path, name: str, binary: str, files: str) -> WorkloadController:
        """Raises `BinariesMissing` naming what is absent and how to build it."""
        exe, manifests = bin_dir / binary, bin_dir / "workloads" / files
        missing = [
            str(p) for p in (exe, manifests / "crds", manifests / "webhook") if not p.exists()
        ]
        if missing:
            raise BinariesMissing(f"{name} not built: missing {', '.join(missing)}; {BUILD_HINT}")
        return cls(name=name, binary=exe, files=manifests)


def locate_jobset(bin_dir: Path) -> WorkloadController:
    return WorkloadController.locate(bin_dir, "JobSet controller", "jobset-manager", "jobset")


def locate_training_operator(bin_dir: Path) -> WorkloadController:
    return WorkloadController.locate(
        bin_dir,
        "PyTorchJob controller (training-operator)",
        "training-operator",
        "training-operator",
    )


def crd_file(bin_dir: Path, crd: str) -> Path | None:
    """The CRD manifest of ``crd`` (e.g. `JOBSET_CRD`) from the built sources, or None."""
    group_plural = {
        JOBSET_CRD: ("jobset", "jobset.x-k8s.io_jobsets.yaml"),
        PYTORCHJOB_CRD: ("training-operator", "kubeflow.org_pytorchjobs.yaml"),
    }[crd]
    path = bin_dir / "workloads" / group_plural[0] / "crds" / group_plural[1]
    return path if path.is_file() else None


# --------------------------------------------------------------------------- certificates


def write_serving_pair(
    directory: Path, dns_names: tuple[str, ...] = (), *, ca_name: str = "strata-e2e-workloads-ca"
) -> dict[str, bytes]:
    """A fresh CA and a serving certificate it signs for 127.0.0.1 and ``dns_names``; writes
    ``ca.crt``, ``ca.key``, ``tls.crt``, ``tls.key`` (controller-runtime's and cert-controller's
    names) into ``directory`` and returns them as PEM bytes by file name.

    Shaped for cert-controller's checks (training-operator v1.8.1): RSA 2048 keys in PKCS#1 PEM,
    one year of validity (it renews what expires within 90 days), and ``ca_name`` as the CA's
    DNS SAN (it verifies the CA certificate for its ``CAName``)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])

    def builder(subject: x509.Name, key: rsa.RSAPrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=365))
        )

    ca = (
        builder(issuer, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, True, False, False, True, True, False, False), True
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(ca_name)]), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    sans += [x509.DNSName(n) for n in dns_names]
    leaf = (
        builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(x509.SubjectAlternativeName(sans), False)
        .sign(ca_key, hashes.SHA256())
    )

    def key_pem(k: rsa.RSAPrivateKey) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,  # PKCS#1 for RSA
            serialization.NoEncryption(),
        )

    files = {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "ca.key": key_pem(ca_key),
        "tls.crt": leaf.public_bytes(serialization.Encoding.PEM),
        "tls.key": key_pem(key),
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
        (directory / name).chmod(0o600)
    return files


# --------------------------------------------------------------------------- helpers


def wait_established(cluster: LocalCluster, crd: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(urllib.error.HTTPError):
            obj = cluster.request(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
        time.sleep(0.2)
    raise RuntimeError(f"CRD {crd} not Established after {timeout} s")


def apply_crd(cluster: LocalCluster, path: Path, crd: str) -> None:
    """Server-side apply of a CRD manifest (forcing conflicts: a session may have applied another
    copy of it before) and wait until it is Established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    wait_established(cluster, crd)


def _ready(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The subset of RFC 6902 kustomize patches use here: ``replace`` of a path of keys/indices."""
    out = copy.deepcopy(doc)
    for op in ops:
        if op["op"] != "replace":
            raise ValueError(f"unsupported patch op {op['op']!r} in a webhook patch")
        parts = [p for p in op["path"].split("/") if p]
        target: Any = out
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = op["value"]
        else:
            target[last] = op["value"]
    return out


def _url_client_config(hook: dict[str, Any], port: int, ca_pem: bytes) -> dict[str, Any]:
    path = hook["clientConfig"]["service"]["path"]
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(ca_pem).decode()}


class _ControllerProcess:
    """Common part: one process with its log, stopped by process group."""

    def __init__(self, cluster: LocalCluster, tool: WorkloadController, workdir: Path) -> None:
        self.cluster = cluster
        self.tool = tool
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.health_port = free_port()
        self.webhook_port = free_port()
        self.component: Component | None = None

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.tool.binary.name}.log"

    def log_tail(self, lines: int = 40) -> str:
        return self.component.log_tail(lines) if self.component else ""

    def _run(self, argv: list[str], env: dict[str, str], timeout: float) -> None:
        self.component = Component(self.tool.binary.name, argv, self.log)
        self.component.start({**self.cluster.env, **env}, die_with_parent=True)
        deadline = time.monotonic() + timeout
        while not _ready(f"http://127.0.0.1:{self.health_port}/readyz"):
            if not self.component.alive():
                raise RuntimeError(f"{self.tool.name} exited; log {self.log}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.tool.name} not ready after {timeout} s; log {self.log}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.25)

    def alive(self) -> bool:
        return self.component is not None and self.component.alive()

    def _stop_process(self) -> None:
        if self.component is not None:
            self.component.stop()
            self.component = None


class JobSetController(_ControllerProcess):
    """The JobSet controller with its webhooks (see the module docstring)."""

    @property
    def webhook_names(self) -> tuple[str, str]:
        return (f"{JOBSET_WEBHOOK_PREFIX}-mutating", f"{JOBSET_WEBHOOK_PREFIX}-validating")

    def start(self, timeout: float = 120.0) -> float:
        """Install the CRD, start the controller, register its webhooks; returns seconds."""
        begin = time.monotonic()
        apply_crd(
            self.cluster, self.tool.files / "crds" / "jobset.x-k8s.io_jobsets.yaml", JOBSET_CRD
        )
        certs = self.workdir / "certs"
        pem = write_serving_pair(certs)
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
        }
        config_file = self.workdir / "jobset-config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        argv = [
            str(self.tool.binary),
            f"--config={config_file}",
            "--leader-elect=false",
            "--metrics-bind-address=0",
            f"--health-probe-bind-address=127.0.0.1:{self.health_port}",
            "--zap-log-level=info",
        ]
        self._run(argv, {"KUBECONFIG": str(self.cluster.kubeconfig)}, timeout)
        for obj in self.webhook_configurations(pem["ca.crt"]):
            self.cluster.kubectl(
                "apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(obj)
            )
        return time.monotonic() - begin

    def webhook_configurations(self, ca_pem: bytes) -> list[dict[str, Any]]:
        """``config/components/webhook/manifests.yaml`` with its kustomize patches, renamed to
        `webhook_names` and pointed at this process."""
        hooks_dir = self.tool.files / "webhook"
        docs = [d for d in yaml.safe_load_all((hooks_dir / "manifests.yaml").read_text()) if d]
        patches = {
            "MutatingWebhookConfiguration": "mutating-patch.yaml",
            "ValidatingWebhookConfiguration": "validating-patch.yaml",
        }
        out = []
        for doc in docs:
            patch = hooks_dir / "patches" / patches[doc["kind"]]
            if patch.is_file():
                doc = _json6902(doc, yaml.safe_load(patch.read_text()))
            mutating = doc["kind"] == "MutatingWebhookConfiguration"
            doc["metadata"] = {"name": self.webhook_names[0 if mutating else 1]}
            for hook in doc["webhooks"]:
                hook["clientConfig"] = _url_client_config(hook, self.webhook_port, ca_pem)
            out.append(doc)
        return out

    def stop(self) -> None:
        """Remove the webhook configurations (failurePolicy Fail) first, then the process."""
        for kind, name in zip(
            ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"),
            self.webhook_names,
            strict=True,
        ):
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found")
        self._stop_process()


class TrainingOperator(_ControllerProcess):
    """The training-operator with only its PyTorchJob controller and webhook."""

    namespace = TRAINING_OPERATOR_NAMESPACE
    _created_rotator_file = False

    def start(self, timeout: float = 120.0) -> float:
        """Install the PyTorchJob CRD, the webhook Secret and configuration, start; seconds."""
        begin = time.monotonic()
        apply_crd(
            self.cluster, self.tool.files / "crds" / "kubeflow.org_pytorchjobs.yaml", PYTORCHJOB_CRD
        )
        dns = f"{TRAINING_OPERATOR_SERVICE}.{self.namespace}.svc"
        pem = write_serving_pair(self.workdir / "certs", (dns,), ca_name=TRAINING_OPERATOR_CA)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": TRAINING_OPERATOR_SECRET, "namespace": self.namespace},
            "data": {k: base64.b64encode(v).decode() for k, v in pem.items()},
        }
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}}
        vwc = self.webhook_configuration(pem["ca.crt"])
        for obj in (namespace, secret, vwc):
            self.cluster.kubectl(
                "apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(obj)
            )
        argv = [
            str(self.tool.binary),
            "--enable-scheme=pytorchjob",
            "--leader-elect=false",
            "--metrics-bind-address=0",
            f"--health-probe-bind-address=127.0.0.1:{self.health_port}",
            f"--webhook-server-port={self.webhook_port}",
            f"--webhook-service-name={TRAINING_OPERATOR_SERVICE}",
            f"--webhook-secret-name={TRAINING_OPERATOR_SECRET}",
            "--zap-log-level=info",
        ]
        # What the kubelet's Secret volume would do: the webhook server reads the certificate from
        # $TMPDIR/k8s-webhook-server/serving-certs (controller-runtime), and the rotator waits
        # until /tmp/k8s-webhook-server/serving-certs/tls.crt exists (hard-coded in v1.8.1).
        tmpdir = self.workdir / "tmp"
        serving = tmpdir / "k8s-webhook-server" / "serving-certs"
        serving.mkdir(parents=True, exist_ok=True)
        for name, data in pem.items():
            (serving / name).write_bytes(data)
        if not (ROTATOR_CERT_DIR / "tls.crt").exists():
            ROTATOR_CERT_DIR.mkdir(parents=True, exist_ok=True)
            (ROTATOR_CERT_DIR / "tls.crt").write_bytes(pem["tls.crt"])
            self._created_rotator_file = True
        env = {
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "MY_POD_NAMESPACE": self.namespace,
            "TMPDIR": str(tmpdir),
        }
        self._run(argv, env, timeout)
        return time.monotonic() - begin

    def webhook_configuration(self, ca_pem: bytes) -> dict[str, Any]:
        """``manifests/base/webhook`` (named as its kustomize patch names it), PyTorchJob only."""
        doc = next(
            d
            for d in yaml.safe_load_all(
                (self.tool.files / "webhook" / "manifests.yaml").read_text()
            )
            if d and d["kind"] == "ValidatingWebhookConfiguration"
        )
        hooks = [h for h in doc["webhooks"] if "pytorchjob" in h["clientConfig"]["service"]["path"]]
        for hook in hooks:
            hook["clientConfig"] = _url_client_config(hook, self.webhook_port, ca_pem)
        return {**doc, "metadata": {"name": TRAINING_OPERATOR_VWC}, "webhooks": hooks}

    def stop(self) -> None:
        self._stop_process()
        self.cluster.kubectl(
            "delete", "validatingwebhookconfiguration", TRAINING_OPERATOR_VWC, "--ignore-not-found"
        )
        if self._created_rotator_file:
            with contextlib.suppress(OSError):
                (ROTATOR_CERT_DIR / "tls.crt").unlink()
            self._created_rotator_file = False
