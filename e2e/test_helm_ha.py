"""The chart with several operator replicas (``replicaCount`` > 1), rendered by ``helm template``.

What two replicas need from the chart (strata_operator.leadership): a RollingUpdate that never
goes below the replica count, replicas on different nodes when possible, a PodDisruptionBudget
that keeps one, ONE serving certificate for all of them (Helm-generated when cert-manager is off),
leader election on, its Lease and the pod role label granted in the release namespace only, and a
reports Service that selects the leader. The one-replica rendering is checked by
``e2e/test_helm.py`` (unchanged: Recreate, ``maxUnavailable: 1``).
"""

from __future__ import annotations

import base64
import datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from e2e.cluster import Binaries
from e2e.test_helm import CHART, KUBE_VERSION, Helm
from strata_operator import main
from strata_operator.leadership import ROLE_LABEL

pytestmark = pytest.mark.e2e

NS = "strata-system"
HA = ["replicaCount=2"]


@pytest.fixture(scope="module")
def chart(k8s_binaries: Binaries) -> Helm:
    path = k8s_binaries.bin_dir / "helm"
    if not path.is_file():
        pytest.fail(f"helm is missing from {k8s_binaries.bin_dir}: run `make tools`")
    return Helm(path, None)


def _one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def _args(objects: list[dict[str, Any]]) -> list[str]:
    deploy = _one(objects, "Deployment")
    return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


@pytest.mark.parametrize(
    "values", [HA, [*HA, "certManager.enabled=true"], ["replicaCount=3", "affinity.x=1"]]
)
def test_helm_lint_strict_with_replicas(chart: Helm, values: list[str]) -> None:
    sets = [a for v in values for a in ("--set", v)]
    proc = chart("lint", "--strict", str(CHART), *sets, check=False)
    if "affinity.x=1" in values:  # affinity is free-form: any object is accepted
        assert proc.returncode == 0, proc.stdout
    else:
        assert proc.returncode == 0 and "0 chart(s) failed" in proc.stdout, proc.stdout


def test_two_replicas_roll_without_a_gap_spread_and_keep_one_through_drains(chart: Helm) -> None:
    objects = chart.template(NS, HA)
    spec = _one(objects, "Deployment")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    )
    (container,) = spec["template"]["spec"]["containers"]
    # Out of the endpoints before SIGTERM: the API server does not retry a webhook call.
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > 5
    single = _one(chart.template(NS, []), "Deployment")["spec"]["template"]["spec"]
    assert "lifecycle" not in single["containers"][0]
    pdb = _one(objects, "PodDisruptionBudget")["spec"]
    assert pdb == {"minAvailable": 1, "selector": {"matchLabels": spec["selector"]["matchLabels"]}}
    # A user's own affinity replaces the default one.
    custom = chart.template(NS, [*HA, "affinity.nodeAffinity.x=1"])
    assert _one(custom, "Deployment")["spec"]["template"]["spec"]["affinity"] == {
        "nodeAffinity": {"x": 1}
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # 0 replicas: a `failurePolicy: Fail` webhook with no backend refuses every protected pod.
        (["replicaCount=0"], "at '/replicaCount': minimum: got 0, want 1"),
        (
            [*HA, "shutdownDelaySeconds=-1"],
            "at '/shutdownDelaySeconds': minimum: got -1, want 0",
        ),
        # The preStop sleep counts against the grace period: nothing left to stop gracefully.
        (
            [*HA, "shutdownDelaySeconds=30"],
            "shutdownDelaySeconds (30) must be less than terminationGracePeriodSeconds (30)",
        ),
        (
            [*HA, "shutdownDelaySeconds=10", "terminationGracePeriodSeconds=5"],
            "shutdownDelaySeconds (10) must be less than terminationGracePeriodSeconds (5)",
        ),
    ],
)
def test_install_refuses_no_replicas_and_a_shutdown_delay_past_the_grace_period(
    chart: Helm, values: list[str], message: str
) -> None:
    sets = [a for v in values for a in ("--set", v)]
    proc = chart("template", "x", str(CHART), "--kube-version", KUBE_VERSION, *sets, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    # What is still accepted: a delay below the grace period, and any delay with one replica
    # (no preStop sleep is rendered then).
    for ok in (
        [*HA, "shutdownDelaySeconds=29"],
        [*HA, "shutdownDelaySeconds=0", "terminationGracePeriodSeconds=0"],
        ["shutdownDelaySeconds=60"],
    ):
        chart.template(NS, ok)


def test_one_replica_with_a_delay_past_the_grace_period_keeps_the_whole_grace_period(
    chart: Helm,
) -> None:
    """Why the chart accepts ``shutdownDelaySeconds >= terminationGracePeriodSeconds`` with one
    replica: no preStop sleep is rendered (there is no other endpoint to drain to), so SIGTERM
    comes at once and the operator has the whole grace period to stop; refusing the value would
    only fail installs over a setting that does nothing."""
    spec = _one(
        chart.template(NS, ["shutdownDelaySeconds=60", "terminationGracePeriodSeconds=30"]),
        "Deployment",
    )["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 30
    assert all("lifecycle" not in c for c in spec["containers"])


def test_every_replica_elects_with_the_chart_lease_and_the_operator_accepts_the_flags(
    chart: Helm, tmp_path: Path
) -> None:
    for values in ([], HA):
        objects = chart.template(NS, values)
        args = _args(objects)
        assert "--leader-elect" in args
        assert f"--leader-election-namespace={NS}" in args
        assert "--leader-election-name=strata" in args
        assert {"--lease-duration=15", "--renew-deadline=10", "--retry-period=2"} <= set(args)
        # The operator's own parser takes every chart flag (the TLS directory made local).
        local = [a for a in args if not a.startswith("--tls-")]
        parsed = main.build_parser().parse_args([*local, f"--tls-workdir={tmp_path}"])
        assert parsed.leader_elect and parsed.lease_duration == 15
        assert parsed.report_url == "https://strata-reports.strata-system.svc:8444"
    tuned = chart.template(
        NS,
        [
            *HA,
            "leaderElection.leaseDuration=30",
            "leaderElection.renewDeadline=20",
            "leaderElection.retryPeriod=4",
        ],
    )
    assert {"--lease-duration=30", "--renew-deadline=20", "--retry-period=4"} <= set(_args(tuned))


def test_replicas_share_one_helm_generated_certificate_for_both_services(chart: Helm) -> None:
    objects = chart.template(NS, HA)
    secret = _one(objects, "Secret", "strata-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    leaf = x509.load_pem_x509_certificate(data["tls.crt"])
    assert leaf.issuer == ca.subject
    public = ca.public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    assert leaf.signature_hash_algorithm is not None
    public.verify(
        leaf.signature,
        leaf.tbs_certificate_bytes,
        padding.PKCS1v15(),
        leaf.signature_hash_algorithm,
    )
    names = set(
        leaf.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value.get_values_for_type(x509.DNSName)
    )
    assert {
        "strata.strata-system.svc",
        "strata.strata-system.svc.cluster.local",
        "strata-reports.strata-system.svc",
        "strata-reports.strata-system.svc.cluster.local",
    } <= names
    assert leaf.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(
        days=3000
    )
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "strata-webhook-tls"
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] is True
    args = _args(objects)
    # Mounted, not generated per start; the operator still writes the (shared) caBundle.
    assert "--tls-dir=/var/run/strata/tls" in args
    assert not any(a.startswith("--tls-workdir") for a in args)
    assert "--no-manage-webhook" not in args
    # One replica keeps generating its own at every start (nothing for helm template to pin).
    single = chart.template(NS, [])
    assert [o for o in single if o["kind"] == "Secret"] == []
    assert "--tls-workdir=/var/run/strata/tls" in _args(single)


def test_cert_manager_issues_the_one_certificate_for_both_services(chart: Helm) -> None:
    objects = chart.template(NS, [*HA, "certManager.enabled=true"])
    assert [o for o in objects if o["kind"] == "Secret"] == []
    cert = _one(objects, "Certificate", "strata-webhook")
    assert "strata-reports.strata-system.svc" in cert["spec"]["dnsNames"]
    args = _args(objects)
    assert "--tls-dir=/var/run/strata/tls" in args and "--no-manage-webhook" in args


def test_reports_go_to_the_leader_and_rbac_is_namespaced(chart: Helm) -> None:
    objects = chart.template(NS, HA)
    reports = _one(objects, "Service", "strata-reports")
    assert reports["spec"]["selector"][ROLE_LABEL] == "leader"
    assert [p["name"] for p in reports["spec"]["ports"]] == ["reports"]
    role = _one(objects, "Role", "strata-leader-election")
    assert role["metadata"]["namespace"] == NS
    grants = {
        (g, r, v, tuple(rule.get("resourceNames") or ()))
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert grants == {
        ("coordination.k8s.io", "leases", "create", ()),
        ("coordination.k8s.io", "leases", "get", ("strata",)),
        ("coordination.k8s.io", "leases", "update", ("strata",)),
        ("", "pods", "patch", ()),
    }
    binding = _one(objects, "RoleBinding", "strata-leader-election")
    assert binding["roleRef"]["name"] == "strata-leader-election"
    assert binding["subjects"][0]["name"] == "strata"
    for obj in objects:
        if obj["kind"] in ("Role", "ClusterRole"):
            for rule in obj["rules"]:
                assert "secrets" not in rule["resources"], rule
