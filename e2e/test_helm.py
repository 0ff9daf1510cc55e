"""The Helm chart and the plain manifests on the local control plane (real kube-apiserver,
controller-manager, scheduler, kwok).

- ``helm lint --strict`` and ``helm template`` with the defaults and with every documented switch;
  the rendered objects go through the apiserver's server-side dry run (schema, defaulting,
  admission), and the schema refuses unknown and invalid values;
- the chart's MutatingWebhookConfiguration is exactly the one the operator writes;
- ``helm install`` (kwok marks the operator pod Running), then the operator process runs locally
  with the chart's own arguments and the chart ServiceAccount's token (so the chart's RBAC is what
  it gets), the annotated example Job is labelled and its pods injected through the chart's
  webhook configuration; ``helm upgrade`` with changed values keeps the policy; ``helm uninstall``
  leaves the CRD and the policy and removes the webhook configuration.

cert-manager and prometheus-operator are not installed here: their CRDs are stubs with an open
schema, so the dry run checks the chart's Certificate, Issuer and ServiceMonitor objects only for
group, version, kind and metadata, not their fields.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.cluster import REPO_ROOT, Binaries, LocalCluster, free_port, loopback_env
from e2e.operator_fixtures import ensure_namespace, wait_established
from strata_operator.admission.configuration import (
    WebhookOptions,
    apply_webhook_configuration,
    build_webhook_configuration,
)
from strata_operator.admission.mutation import INJECTED_ANNOTATION, POLICY_LABEL, SIDECAR_NAME

pytestmark = pytest.mark.e2e

CHART = REPO_ROOT / "charts" / "strata"
EXAMPLES = REPO_ROOT / "examples"
CRD = "checkpointpolicies.strata.dev"
KUBE_VERSION = "1.35.4"

# Every documented switch of values.yaml, each set at least once (booleans both ways).
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "cert-manager-own-ca": ["certManager.enabled=true"],
    "cert-manager-cluster-issuer": [
        "certManager.enabled=true",
        "certManager.issuerRef.name=cluster-ca",
        "certManager.issuerRef.kind=ClusterIssuer",
        "certManager.duration=720h",
        "certManager.renewBefore=240h",
    ],
    "service-monitor": [
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.release=prometheus",
        "metrics.serviceMonitor.interval=15s",
    ],
    "monitoring": [
        "metrics.podMonitor.enabled=true",
        "metrics.podMonitor.namespaces={ml,research}",
        "metrics.podMonitor.labels.release=prometheus",
        "metrics.prometheusRule.enabled=true",
        "metrics.prometheusRule.labels.release=prometheus",
        "metrics.prometheusRule.alertLabels.team=ml-infra",
        "metrics.prometheusRule.noDurableStepMinutes=30",
        "metrics.prometheusRule.promotionSlowSeconds=120",
        "metrics.prometheusRule.saveStallSeconds=3",
        "metrics.grafanaDashboard.enabled=true",
    ],
    "no-crds-no-pdb": ["crds.install=false", "podDisruptionBudget.enabled=false"],
    "existing-service-account-no-rbac": [
        "serviceAccount.create=false",
        "serviceAccount.name=strata-preexisting",
        "rbac.create=false",
    ],
    "ignore-debug-tuned": [
        "webhook.failurePolicy=Ignore",
        "webhook.timeoutSeconds=10",
        "webhook.excludedNamespaces={monitoring,batch-system}",
        "operator.logLevel=debug",
        "operator.extraArgs={--dependency-retry=15}",
        "image.tag=0.1.0-rc1",
        "image.pullPolicy=Always",
        "sidecar.image.tag=0.1.0-rc1",
        "imagePullSecrets[0].name=regcred",
        "commonLabels.team=ml-infra",
        "podAnnotations.example\\.com/scrape=true",
        "podLabels.tier=control",
        "nodeSelector.kubernetes\\.io/os=linux",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists",
        "priorityClassName=",
        "serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=strata@p.iam.gserviceaccount.com",
        "reports.audience=strata.example",
        "service.reportsPort=9444",
        "ports.webhook=10443",
        "ports.reports=10444",
        "ports.health=10080",
        "ports.metrics=10095",
        "resources.limits.memory=1Gi",
        "terminationGracePeriodSeconds=60",
        "livenessProbe.periodSeconds=20",
        "fullnameOverride=strata-ops",
        "tests.image.repository=python",
        "tests.image.tag=3.12.8-slim-bookworm",
    ],
    "verbose-name-override": [
        "operator.logLevel=verbose",
        "operator.logFormat=text",
        "nameOverride=ckpt",
    ],
}

STUB_CRDS = [
    ("cert-manager.io", "Certificate", "certificates"),
    ("cert-manager.io", "Issuer", "issuers"),
    ("monitoring.coreos.com", "ServiceMonitor", "servicemonitors"),
    ("monitoring.coreos.com", "PodMonitor", "podmonitors"),
    ("monitoring.coreos.com", "PrometheusRule", "prometheusrules"),
]


def sets(values: list[str]) -> list[str]:
    return [arg for v in values for arg in ("--set", v)]


class Helm:
    def __init__(self, binary: Path, kubeconfig: Path | None) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.binary), *args]
        if self.kubeconfig is not None:
            cmd.append(f"--kubeconfig={self.kubeconfig}")
        home = REPO_ROOT / ".strata-run" / "helm"
        env = {
            **loopback_env(),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def template(
        self, namespace: str, values: list[str], release: str = "strata"
    ) -> list[dict[str, Any]]:
        out = self(
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
            *sets(values),
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def helm_binary(k8s_binaries: Binaries) -> Path:
    path = k8s_binaries.bin_dir / "helm"
    if not path.is_file():
        pytest.fail(f"helm is missing from {k8s_binaries.bin_dir}: run `make tools`")
    return path


@pytest.fixture(scope="session")
def offline_helm(helm_binary: Path) -> Helm:
    return Helm(helm_binary, None)


@pytest.fixture(scope="session")
def helm(helm_binary: Path, k8s_cluster: LocalCluster) -> Helm:
    return Helm(helm_binary, k8s_cluster.kubeconfig)


@pytest.fixture(scope="session")
def stub_crds(k8s_cluster: LocalCluster) -> None:
    """Open-schema CRDs for the cert-manager and prometheus-operator kinds the chart can render."""
    for group, kind, plural in STUB_CRDS:
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }
        k8s_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd))
        wait_established(k8s_cluster, f"{plural}.{group}")


# --- lint, template, schema ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict(offline_helm: Helm, name: str) -> None:
    proc = offline_helm(
        "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *sets(VALUE_SETS[name])
    )
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("replicas=2", "additional properties 'replicas' not allowed"),
        ("webhook.failurePolicy=Maybe", "value must be one of 'Fail', 'Ignore'"),
        ("webhook.timeoutSeconds=31", "maximum"),
        ("ports.webhook=0", "minimum"),
        ("certManager.issuerRef.kind=Vault", "value must be one of 'Issuer', 'ClusterIssuer'"),
        ("crds.install=yes", "got string, want boolean"),
        ("webhook.excludedNamespaces={Bad_Name}", "does not match pattern"),
    ],
)
def test_schema_refuses_unknown_and_invalid_values(
    offline_helm: Helm, value: str, message: str
) -> None:
    proc = offline_helm(
        "template", "x", str(CHART), "--kube-version", KUBE_VERSION, "--set", value, check=False
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_every_object_is_labelled_and_the_operator_pod_is_restricted(offline_helm: Helm) -> None:
    for name, values in VALUE_SETS.items():
        objects = offline_helm.template("strata-system", values)
        for obj in objects:
            labels = obj["metadata"].get("labels") or {}
            for key in (
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/version",
                "app.kubernetes.io/managed-by",
                "app.kubernetes.io/component",
                "app.kubernetes.io/part-of",
            ):
                assert key in labels, (name, obj["kind"], obj["metadata"]["name"], key)
        (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
        spec = deploy["spec"]
        assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        security = container["securityContext"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
        if "crds.install=false" in values:
            assert crds == []
        else:
            (crd,) = crds
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            generated = yaml.safe_load((REPO_ROOT / "crds" / f"{CRD}.yaml").read_text())
            assert crd["spec"] == generated["spec"], "the chart's CRD is not the generated one"


IDENTITY = """
import getpass, os, pwd
from kopf._core.engines.peering import detect_own_id
os.setgid(65532); os.setuid(65532)  # after the imports: the interpreter's files are root's
print(detect_own_id(manual=False))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as the image's uid 65532")
def test_the_operator_pod_gives_kopf_its_identity(offline_helm: Helm) -> None:
    """The image runs as uid 65532, which has no passwd entry: kopf's identity then comes from
    POD_ID (the chart sets it to the pod's name), or kopf stops at start with KeyError."""
    (deploy,) = [o for o in offline_helm.template("strata-system", []) if o["kind"] == "Deployment"]
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    bare = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    without = subprocess.run(
        [sys.executable, "-c", IDENTITY], env=bare, capture_output=True, text=True, timeout=60
    )
    assert without.returncode != 0 and "KeyError" in without.stderr, without
    with_id = subprocess.run(
        [sys.executable, "-c", IDENTITY],
        env={**bare, "POD_ID": "strata-operator-0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert with_id.returncode == 0 and with_id.stdout.strip() == "strata-operator-0", with_id


def test_rbac_has_explicit_verbs_and_nothing_on_secrets(offline_helm: Helm) -> None:
    for values in ([], ["certManager.enabled=true"]):
        objects = offline_helm.template("strata-system", values)
        for role in (o for o in objects if o["kind"] in ("ClusterRole", "Role")):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
                assert "*" not in rule.get("apiGroups", []), rule
                assert "secrets" not in rule["resources"], rule
        (cluster_role,) = [o for o in objects if o["kind"] == "ClusterRole"]
        grants = {
            (g, r, v)
            for rule in cluster_role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        for read_only in (
            ("", "pods"),
            ("batch", "jobs"),
            ("jobset.x-k8s.io", "jobsets"),
            ("kubeflow.org", "pytorchjobs"),
        ):
            verbs = {v for g, r, v in grants if (g, r) == read_only}
            assert verbs == {"get", "list", "watch"}, (read_only, verbs)
        assert ("authentication.k8s.io", "tokenreviews", "create") in grants
        assert ("strata.dev", "checkpointpolicies/status", "patch") in grants
        writes = {v for g, r, v in grants if r == "mutatingwebhookconfigurations"} - {
            "get",
            "list",
            "watch",
        }
        assert writes == (set() if values else {"create", "patch", "update"})


def test_chart_webhook_configuration_is_the_one_the_operator_writes(offline_helm: Helm) -> None:
    for values in (
        [],
        [
            "certManager.enabled=true",
            "webhook.failurePolicy=Ignore",
            "webhook.timeoutSeconds=9",
            "webhook.excludedNamespaces={ops}",
        ],
    ):
        objects = offline_helm.template("strata-system", values)
        (mwc,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
        (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
        opts = webhook_options(deploy["spec"]["template"]["spec"]["containers"][0]["args"])
        expected = build_webhook_configuration(opts, ca_bundle=b"")
        for hook in expected["webhooks"]:
            del hook["clientConfig"]["caBundle"]
        assert mwc["metadata"]["name"] == expected["metadata"]["name"]
        assert sorted(mwc["webhooks"], key=lambda h: h["name"]) == sorted(
            expected["webhooks"], key=lambda h: h["name"]
        )
        injected = (mwc["metadata"].get("annotations") or {}).get("cert-manager.io/inject-ca-from")
        assert (injected is not None) == bool(values)


def webhook_options(chart_args: list[str]) -> WebhookOptions:
    """The operator's webhook options as the chart's Deployment arguments set them."""
    args = dict(a.removeprefix("--").split("=", 1) for a in chart_args if "=" in a)
    excluded = [a.split("=", 1)[1] for a in chart_args if a.startswith("--exclude-namespace=")]
    return WebhookOptions(
        service=args["webhook-service"],
        configuration_name=args["webhook-config-name"],
        failure_policy=args["failure-policy"],  # type: ignore[arg-type]
        timeout_seconds=int(args["webhook-timeout"]),
        excluded_namespaces=("kube-system", *excluded),
        operator_namespace=args["operator-namespace"],
    )


# --- the real apiserver ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_objects_pass_server_side_dry_run(
    helm: Helm, k8s_cluster: LocalCluster, k8s_namespace: str, stub_crds: None, name: str
) -> None:
    objects = helm.template(k8s_namespace, VALUE_SETS[name])
    rendered = yaml.safe_dump_all(objects)
    out = k8s_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    assert out.count("(server dry run)") == len(objects), out


def test_manifests_file_passes_server_side_dry_run(k8s_cluster: LocalCluster) -> None:
    path = REPO_ROOT / "manifests" / "strata.yaml"
    objects = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert objects[0]["kind"] == "Namespace"
    # Dry run cannot create the namespace for the objects inside it: create it for real first.
    ensure_namespace(k8s_cluster, objects[0]["metadata"]["name"])
    out = k8s_cluster.kubectl("apply", "--dry-run=server", "-f", str(path))
    assert out.count("(server dry run)") == len(objects), out


def test_examples_pass_server_side_dry_run(
    k8s_cluster: LocalCluster, k8s_namespace: str, workload_crds: dict[str, str]
) -> None:
    ensure_crd(k8s_cluster)
    out = k8s_cluster.kubectl("apply", "--dry-run=server", "-n", k8s_namespace, "-f", str(EXAMPLES))
    for kind in (
        "checkpointpolicy.strata.dev/demo",
        "checkpointpolicy.strata.dev/llm",
        "job.batch/strata-train-job",
        "jobset.jobset.x-k8s.io/strata-train-jobset",
        "pytorchjob.kubeflow.org/strata-train-pytorchjob",
    ):
        assert kind in out, out


def ensure_crd(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
    wait_established(cluster, CRD)


# --- install, inject, upgrade, uninstall ----------------------------------------------------


def adopt_crd_for(cluster: LocalCluster, release: str, namespace: str) -> None:
    """Let Helm take over a CRD applied before (kubectl apply -f crds/, another release): Helm's
    documented adoption, the same a user runs (README: Install on Kubernetes)."""
    found = cluster.kubectl("get", "crd", CRD, "--ignore-not-found", "-o", "name")
    if not found.strip():
        return
    cluster.kubectl("label", "--overwrite", "crd", CRD, "app.kubernetes.io/managed-by=Helm")
    cluster.kubectl(
        "annotate",
        "--overwrite",
        "crd",
        CRD,
        f"meta.helm.sh/release-name={release}",
        f"meta.helm.sh/release-namespace={namespace}",
    )


def service_account_kubeconfig(cluster: LocalCluster, namespace: str, sa: str, path: Path) -> Path:
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": cluster.server,
                    "certificate-authority-data": base64.b64encode(
                        Path(cluster.ca_file).read_bytes()
                    ).decode(),
                },
            }
        ],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "local", "user": sa}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def local_operator_argv(
    chart_args: list[str], kubeconfig: Path, workdir: Path, ports: dict[str, int]
) -> list[str]:
    """The chart's operator arguments, with only what differs outside a pod replaced: listen
    addresses and ports on loopback, the webhook reached by URL (no kube-proxy here) instead of
    the Service, the TLS work directory."""
    replaced = {
        "--liveness": f"http://127.0.0.1:{ports['health']}/healthz",
        "--webhook-listen": "127.0.0.1",
        "--webhook-port": str(ports["webhook"]),
        "--webhook-service": None,
        "--tls-workdir": str(workdir / "tls"),
        "--report-listen": "127.0.0.1",
        "--report-port": str(ports["reports"]),
        "--metrics-listen": "127.0.0.1",
        "--metrics-port": str(ports["metrics"]),
    }
    argv = [
        sys.executable,
        "-m",
        "strata_operator",
        f"--kubeconfig={kubeconfig}",
        "--webhook-host=127.0.0.1",
        "--no-bucket-check",
    ]
    for arg in chart_args:
        key = arg.split("=", 1)[0]
        if key in replaced:
            if replaced[key] is not None:
                argv.append(f"{key}={replaced[key]}")
        else:
            argv.append(arg)
    missing = {k for k, v in replaced.items() if v is not None} - {a.split("=", 1)[0] for a in argv}
    assert not missing, f"the chart no longer passes {missing}; update this test"
    return argv


def http_get(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=3) as resp:
            return int(resp.status)
    except OSError:
        return 0


def wait_for(what: str, check: Any, timeout: float = 90.0, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))


@pytest.fixture
def workload_namespace(k8s_cluster: LocalCluster) -> Iterator[str]:
    name = f"helm-workloads-{uuid.uuid4().hex[:6]}"
    ensure_namespace(k8s_cluster, name)
    wait_for(
        "the default ServiceAccount",
        lambda: k8s_cluster.kubectl(
            "get", "sa", "default", "-n", name, "--ignore-not-found", "-o", "name"
        ).strip(),
    )
    try:
        yield name
    finally:
        k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def test_install_inject_upgrade_uninstall(
    helm: Helm,
    k8s_cluster: LocalCluster,
    k8s_fake_node: str,
    k8s_namespace: str,
    workload_namespace: str,
    tmp_path: Path,
) -> None:
    release, ns = "strata", k8s_namespace
    fullname = "strata"
    config_name = f"{fullname}.strata.dev"
    adopt_crd_for(k8s_cluster, release, ns)
    operator: subprocess.Popen[bytes] | None = None
    log = tmp_path / "operator.log"
    try:
        helm("install", release, str(CHART), "--namespace", ns, "--wait", "--timeout", "180s")
        # kwok runs the operator pod: the Deployment is available and the pod Running.
        deploy = get_json(k8s_cluster, "deployment", fullname, "-n", ns)
        assert deploy["status"].get("availableReplicas") == 1, deploy["status"]
        pods = get_json(k8s_cluster, "pods", "-n", ns, "-l", "app.kubernetes.io/component=operator")
        assert [p["status"]["phase"] for p in pods["items"]] == ["Running"]
        crd = get_json(k8s_cluster, "crd", CRD)
        mwc = get_json(k8s_cluster, "mutatingwebhookconfiguration", config_name)
        assert {h["name"].split(".")[0] for h in mwc["webhooks"]} == {
            "inject-pods",
            "label-jobs",
            "label-jobsets",
            "label-pytorchjobs",
        }

        # The operator process, with the chart's arguments and the chart's RBAC.
        chart_args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        sa = deploy["spec"]["template"]["spec"]["serviceAccountName"]
        kubeconfig = service_account_kubeconfig(k8s_cluster, ns, sa, tmp_path / "sa.kubeconfig")
        ports = {k: free_port() for k in ("health", "webhook", "reports", "metrics")}
        argv = local_operator_argv(chart_args, kubeconfig, tmp_path, ports)
        with log.open("wb") as out:
            operator = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env={**loopback_env(), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        health = f"http://127.0.0.1:{ports['health']}/healthz"
        wait_for(
            "the operator's liveness endpoint (the chart's probe path)",
            lambda: http_get(health) == 200,
            log=log,
        )
        ca = tmp_path / "tls" / "ca.crt"
        wait_for(
            "the operator's CA in the chart's webhook configuration",
            lambda: (
                ca.is_file()
                and all(
                    base64.b64decode(h["clientConfig"].get("caBundle", "")) == ca.read_bytes()
                    for h in get_json(k8s_cluster, "mutatingwebhookconfiguration", config_name)[
                        "webhooks"
                    ]
                )
            ),
            log=log,
        )

        # The newcomer's path: PVC, policy, annotated example Job.
        wl = workload_namespace
        for name in ("pvc.yaml", "policy.yaml"):
            k8s_cluster.kubectl("apply", "-n", wl, "-f", str(EXAMPLES / name))
        policy = get_json(k8s_cluster, "ckpol", "demo", "-n", wl)
        wait_for(
            "the operator to reconcile the policy (observedGeneration)",
            lambda: (
                (get_json(k8s_cluster, "ckpol", "demo", "-n", wl).get("status") or {}).get(
                    "observedGeneration"
                )
                == policy["metadata"]["generation"]
            ),
            log=log,
        )
        k8s_cluster.kubectl("apply", "-n", wl, "-f", str(EXAMPLES / "job.yaml"))
        job = get_json(k8s_cluster, "job", "strata-train-job", "-n", wl)
        assert job["spec"]["template"]["metadata"]["labels"][POLICY_LABEL] == "demo"

        def injected_pods() -> list[dict[str, Any]]:
            items = get_json(
                k8s_cluster, "pods", "-n", wl, "-l", "batch.kubernetes.io/job-name=strata-train-job"
            )["items"]
            return items if len(items) == 2 else []

        for pod in wait_for("the Job's 2 pods", injected_pods, log=log):
            sidecars = [c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
            assert len(sidecars) == 1 and sidecars[0]["restartPolicy"] == "Always"
            # The policy names no image: the operator's --sidecar-image (chart sidecar.image).
            assert sidecars[0]["image"] == "ghcr.io/strata-dev/strata:0.1.0"
            assert pod["metadata"]["annotations"][INJECTED_ANNOTATION] == "demo"
        metrics = (
            urllib.request.build_opener(urllib.request.ProxyHandler({}))
            .open(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5)
            .read()
            .decode()
        )
        # This operator (through the chart's configuration) answered the Job and its pods.
        assert 'strata_admission_requests_total{kind="Job"' in metrics, metrics
        assert 'strata_admission_requests_total{kind="Pod"' in metrics, metrics

        # Here the operator runs outside the cluster and wrote URL clientConfigs; in a pod it
        # writes Service ones. Put back exactly what it writes in a pod (its own function), so
        # that the upgrade meets what it meets in a real cluster.
        operator.send_signal(signal.SIGTERM)
        operator.wait(30)
        in_pod = build_webhook_configuration(webhook_options(chart_args), ca_bundle=ca.read_bytes())
        with k8s_cluster.api_client() as api_client:
            apply_webhook_configuration(client.AdmissionregistrationV1Api(api_client), in_pod)

        # Upgrade with changed values: the policy and the CRD stay the same objects, and the
        # operator's caBundle survives Helm's patch.
        helm(
            "upgrade",
            release,
            str(CHART),
            "--namespace",
            ns,
            "--wait",
            "--timeout",
            "180s",
            "--set",
            "webhook.timeoutSeconds=7",
            "--set",
            "resources.limits.memory=768Mi",
        )
        deploy = get_json(k8s_cluster, "deployment", fullname, "-n", ns)
        container = deploy["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["memory"] == "768Mi"
        assert "--webhook-timeout=7" in container["args"]
        mwc = get_json(k8s_cluster, "mutatingwebhookconfiguration", config_name)
        assert {h["timeoutSeconds"] for h in mwc["webhooks"]} == {7}
        assert all(
            base64.b64decode(h["clientConfig"]["caBundle"]) == ca.read_bytes()
            for h in mwc["webhooks"]
        )
        after = get_json(k8s_cluster, "ckpol", "demo", "-n", wl)
        assert after["metadata"]["uid"] == policy["metadata"]["uid"]
        assert after["spec"] == policy["spec"]
        assert get_json(k8s_cluster, "crd", CRD)["metadata"]["uid"] == crd["metadata"]["uid"]

        # Uninstall: the CRD and the policy stay; the webhook configuration goes.
        helm("uninstall", release, "--namespace", ns, "--wait", "--timeout", "120s")
        assert get_json(k8s_cluster, "crd", CRD)["metadata"]["uid"] == crd["metadata"]["uid"]
        kept = get_json(k8s_cluster, "ckpol", "demo", "-n", wl)
        assert kept["metadata"]["uid"] == policy["metadata"]["uid"]
        assert not k8s_cluster.kubectl(
            "get", "mutatingwebhookconfiguration", config_name, "--ignore-not-found", "-o", "name"
        ).strip()
        assert not k8s_cluster.kubectl(
            "get", "deployment", fullname, "-n", ns, "--ignore-not-found", "-o", "name"
        ).strip()
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGKILL)
            operator.wait(10)
        helm("uninstall", release, "--namespace", ns, "--ignore-not-found", check=False)
        # Never leave a fail-closed webhook behind for the rest of the session.
        k8s_cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", config_name, "--ignore-not-found"
        )
