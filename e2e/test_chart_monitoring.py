"""The chart's monitoring objects, rendered by ``helm template`` (no cluster needed): the sidecar
PodMonitor, the operator ServiceMonitor, the PrometheusRule and the Grafana dashboard.

promtool is not available here, so the equivalent checks: every alert and panel expression parses
as PromQL (``promql-parser``, the Rust parser's Python binding), every ``for`` is a Prometheus
duration, every metric an expression names is one that a real ``strata sidecar`` process serves
on /metrics or that the operator registers, and the PodMonitor scrapes the port name and the pod
label the webhook actually injects. All of it is off by default (the default render, and so
manifests/strata.yaml, does not change).
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from tests.fixtures.sidecar import SidecarProcess, free_port

from e2e.cluster import REPO_ROOT, Binaries
from strata.config import StrataConfig
from strata_operator.constants import METRICS_PORT_NAME, POLICY_LABEL

pytestmark = pytest.mark.e2e

CHART = REPO_ROOT / "charts" / "strata"
MONITORING = [
    "metrics.podMonitor.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.grafanaDashboard.enabled=true",
]
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
METRIC = re.compile(r"\bstrata_[a-z0-9_]+")
GRAFANA_VARS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$namespace": ".*",
    "$policy": ".*",
}


def render(helm: Path, *values: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "s", str(CHART), "--namespace", "strata-system"]
    args += ["--kube-version", "1.35.4"]
    for v in values:
        args += ["--set", v]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kinds(objects: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


@pytest.fixture(scope="module")
def helm(k8s_binaries: Binaries) -> Path:
    path = k8s_binaries.bin_dir / "helm"
    if not path.is_file():
        pytest.fail(f"helm is missing from {k8s_binaries.bin_dir}: run `make tools`")
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every series name a real sidecar serves plus every one the operator registers."""
    import importlib
    import os
    import signal
    import sys

    # The operator's metrics register in the process-wide registry when imported.
    for module in ("strata_operator.metrics", "strata_operator.admission.policy_cache"):
        importlib.import_module(module)

    root = tmp_path_factory.mktemp("sidecar")
    shm = Path("/dev/shm") / f"strata-test-monitoring-{os.getpid()}"
    config = StrataConfig.parse(
        {
            "job_id": "ns.monitoring",
            "ram": {"path": str(shm)},
            "pvc": {"path": str(root / "pvc")},
            "metrics_port": free_port(),
            "metrics_host": "127.0.0.1",
        }
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(config.to_env(), PYTHONUNBUFFERED="1")
    log = root / "sidecar.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "sidecar"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    try:
        sidecar = SidecarProcess(config, proc, log)
        sidecar.wait_ready()
        with urllib.request.urlopen(sidecar.metrics_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        subprocess.run(["rm", "-rf", str(shm)], check=False)
    text += generate_latest(REGISTRY).decode()  # the operator's: the process-wide registry
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}_{s}" for s in ("bucket", "sum", "count"))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def check_expr(expr: str, exported: set[str], where: str) -> None:
    try:
        promql_parser.parse(expr)
    except ValueError as err:
        raise AssertionError(f"{where}: not PromQL ({err}): {expr}") from None
    named = set(METRIC.findall(expr))
    assert named, f"{where}: names no strata metric: {expr}"
    unknown = named - exported
    assert not unknown, f"{where}: {sorted(unknown)} are not exported by the sidecar or operator"


def test_monitoring_is_off_by_default(helm: Path) -> None:
    got = kinds(render(helm))
    for kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        assert kind not in got, kind
    assert all("dashboard" not in o["metadata"]["name"] for o in got.get("ConfigMap", []))


def test_pod_monitor_scrapes_the_port_and_pods_the_webhook_injects(helm: Path) -> None:
    got = kinds(render(helm, *MONITORING, "metrics.podMonitor.labels.release=prom"))
    (pm,) = got["PodMonitor"]
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["selector"]["matchExpressions"] == [
        {"key": POLICY_LABEL, "operator": "Exists"}
    ]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == METRICS_PORT_NAME and endpoint["path"] == "/metrics"
    policy_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", POLICY_LABEL)
    assert {"sourceLabels": [policy_label], "targetLabel": "policy"} in endpoint["relabelings"]
    (sm,) = got["ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    only = kinds(render(helm, *MONITORING, "metrics.podMonitor.namespaces={ml,research}"))
    assert only["PodMonitor"][0]["spec"]["namespaceSelector"] == {"matchNames": ["ml", "research"]}


def test_alert_rules_are_valid_and_name_exported_metrics(helm: Path, exported: set[str]) -> None:
    values = [
        *MONITORING,
        "metrics.prometheusRule.alertLabels.team=ml",
        "metrics.prometheusRule.noDurableStepMinutes=45",
    ]
    (rule,) = kinds(render(helm, *values))["PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "StrataNoDurableStep",
        "StrataFlushDoesNotFitGracePeriod",
        "StrataRestoreFailed",
        "StrataPromotionSlow",
        "StrataPromotionFailing",
        "StrataTierTooSmall",
        "StrataPodsUninjected",
        "StrataSaveStallHigh",
    } <= set(alerts)
    for name, r in alerts.items():
        check_expr(r["expr"], exported, name)
        assert "for" not in r or DURATION.match(r["for"]), (name, r["for"])
        assert r["labels"]["severity"] in ("critical", "warning", "info"), name
        assert r["labels"]["team"] == "ml", name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
    assert "[45m]" in alerts["StrataNoDurableStep"]["expr"]
    assert "{{ $labels.pod }}" in alerts["StrataNoDurableStep"]["annotations"]["description"]


def test_dashboard_is_the_chart_file_and_its_panels_query_exported_metrics(
    helm: Path, exported: set[str]
) -> None:
    (cm,) = [
        o
        for o in kinds(render(helm, *MONITORING))["ConfigMap"]
        if "dashboard" in o["metadata"]["name"]
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "strata-system"  # the release's by default
    elsewhere = render(helm, *MONITORING, "metrics.grafanaDashboard.namespace=monitoring")
    (moved,) = [o for o in kinds(elsewhere)["ConfigMap"] if "dashboard" in o["metadata"]["name"]]
    assert moved["metadata"]["namespace"] == "monitoring"
    source = (CHART / "dashboards" / "strata.json").read_text()
    assert json.loads(cm["data"]["strata.json"]) == json.loads(source)
    dash = json.loads(source)
    targets = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 10
    variables = [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    for title, expr in targets:
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        check_expr(expr, exported, title)
    for q in variables:
        inner = re.fullmatch(r"label_values\((.*), \w+\)", q)
        assert inner is not None, q
        check_expr(inner.group(1).replace("$namespace", ".*"), exported, q)


def test_checks_catch_a_metric_nobody_exports(exported: set[str]) -> None:
    check: Callable[[], None] = lambda: check_expr("rate(strata_no_such_total[5m])", exported, "x")  # noqa: E731
    with pytest.raises(AssertionError, match="strata_no_such_total"):
        check()
    with pytest.raises(AssertionError, match="not PromQL"):
        check_expr("sum(rate(strata_restore_total[5m])", exported, "x")
