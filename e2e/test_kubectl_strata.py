"""``kubectl strata`` against the real local control plane, run as kubectl runs plugins: the real
``kubectl`` finds ``kubectl-strata`` on PATH (a shim executing ``python -m
strata_operator.kubectl``, what the console script does) and execs it.

- status / describe: a CheckpointPolicy whose status (conditions, jobs) is written through the
  status subresource as the operator's report receiver writes it, an injected pod of the job and
  a labelled pod the webhook never saw; the plugin must show exactly what the status holds.
- verify: the plugin creates a real batch/v1 Job; the Job controller creates its pod, the
  scheduler binds it to a kwok node; the e2e local kubelet runs the pod's own command (its PVC
  mount mapped to the claim's local directory) as a process and kwok reports its outcome; the
  plugin exits with the verification's code. Checkpoints are real (tests/fixtures/checkpoints).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from tests.fixtures.checkpoints import flip_byte, write_step
from tests.fixtures.pods import PodBuilder, policy_obj

from e2e.cluster import LocalCluster
from e2e.local_kubelet import LocalKubelet
from e2e.operator_fixtures import apply_crds, ensure_namespace
from e2e.test_flow import setup_pvc
from strata.tiers.posix import PosixTier

pytestmark = pytest.mark.e2e

GROUP, VERSION, PLURAL = "strata.dev", "v1alpha1", "checkpointpolicies"


@pytest.fixture(autouse=True)
def crds(k8s_cluster: LocalCluster) -> None:
    apply_crds(k8s_cluster)


@pytest.fixture
def plugin_env(k8s_cluster: LocalCluster, tmp_path: Path) -> dict[str, str]:
    """Environment with ``kubectl-strata`` on PATH and KUBECONFIG set (kubectl passes no flag
    that precedes the plugin name on to a plugin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kubectl-strata"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m strata_operator.kubectl "$@"\n')
    shim.chmod(0o755)
    env = dict(k8s_cluster.env)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    env["KUBECONFIG"] = str(k8s_cluster.kubeconfig)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def kubectl_strata(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "strata", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _now(delta: float = 0.0) -> str:
    return (datetime.now(UTC) - timedelta(seconds=delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_policy(api: client.ApiClient, ns: str, name: str, jobs: list[dict[str, Any]]) -> None:
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, policy_obj(name, ns))
    status = {
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Valid",
                "message": "",
                "lastTransitionTime": _now(60),
            }
        ],
        "jobs": jobs,
    }
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, PLURAL, name, {"status": status}
    )


def test_status_and_describe_show_what_the_policy_status_holds(
    api: client.ApiClient, k8s_namespace: str, plugin_env: dict[str, str]
) -> None:
    ns = k8s_namespace
    job = f"{ns}.train"
    jobs = [
        {
            "jobId": job,
            "newestCompleteStep": {"ram": 1230, "pvc": 1200, "gcs": 1000},
            "lastRestore": {
                "tier": "pvc",
                "step": 1200,
                "seconds": 0.42,
                "outcome": "restored",
                "time": _now(30),
            },
            "lastError": {"tier": "gcs", "message": "gs://b: permission denied", "time": _now(10)},
            "updateTime": _now(5),
        },
        {"jobId": f"{ns}.fresh", "newestCompleteStep": {"ram": 10}, "updateTime": _now(5)},
    ]
    make_policy(api, ns, "fast", jobs)
    core = client.CoreV1Api(api)
    injected = (
        PodBuilder("train-0", ns)
        .container("train")
        .label("job-name", "train")
        .annotation("strata.dev/injected", "fast")
        .obj()
    )
    core.create_namespaced_pod(ns, injected)
    # Created without the label (the webhook never saw it), then labelled: unprotected.
    core.create_namespaced_pod(ns, PodBuilder("stray", ns).container("train").obj())
    core.patch_namespaced_pod("stray", ns, {"metadata": {"labels": {"strata.dev/policy": "fast"}}})

    proc = kubectl_strata(plugin_env, "status", "-A", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in json.loads(proc.stdout) if d["namespace"] == ns]
    assert len(docs) == 1
    d = docs[0]
    assert d["policy"] == "fast" and d["ready"]["status"] == "True"
    assert d["tiers"]["pvc"]["claimName"] == "ckpt"
    by_job = {j["jobId"]: j for j in d["jobs"]}
    assert by_job[job]["newestCompleteStep"] == {"ram": 1230, "pvc": 1200, "gcs": 1000}
    assert (
        by_job[job]["lastRestore"]["tier"] == "pvc" and by_job[job]["lastRestore"]["step"] == 1200
    )
    assert by_job[job]["lastError"]["message"] == "gs://b: permission denied"
    assert by_job[f"{ns}.fresh"]["newestCompleteStep"] == {"ram": 10, "pvc": None, "gcs": None}
    assert d["unprotectedPods"] == ["stray"]

    # The table for people, with --kubeconfig/-n given to the plugin itself.
    proc = kubectl_strata(
        plugin_env, "status", "fast", "-n", ns, "--kubeconfig", plugin_env["KUBECONFIG"]
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{ns}/fast" in out and "Ready=True" in out and job in out
    assert (
        "1230" in out
        and "step 1200 from pvc" in out
        and "unprotected pods" in out
        and "stray" in out
    )

    proc = kubectl_strata(plugin_env, "describe", "job", job, "-o", "yaml")
    assert proc.returncode == 0, proc.stderr
    import yaml

    desc = yaml.safe_load(proc.stdout)
    assert desc["namespace"] == ns and desc["policy"] == "fast"
    assert [p["name"] for p in desc["pods"]] == ["train-0"] and desc["pods"][0]["injected"]
    assert desc["newestCompleteStep"]["gcs"] == 1000

    proc = kubectl_strata(plugin_env, "describe", "job", f"{ns}.nope")
    assert proc.returncode == 3 and "status -A" in proc.stderr
    proc = kubectl_strata(plugin_env, "status", "missing", "-n", ns)
    assert proc.returncode == 3
    proc = kubectl_strata(plugin_env, "status", "--context", "no-such-context")
    assert proc.returncode == 2 and "no-such-context" in proc.stderr


def _run_verify_pod(
    k8s_cluster: LocalCluster,
    api: client.ApiClient,
    kubelet: LocalKubelet,
    ns: str,
    plugin: subprocess.Popen[str],
) -> int:
    """Wait for the verify Job's pod to run (kwok), run its command locally, report the result
    through kwok; returns the command's exit code."""
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + 90
    pod: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        resp = core.list_namespaced_pod(
            ns, label_selector="app.kubernetes.io/name=strata-verify", _preload_content=False
        )
        seen = {p.name for p in kubelet.pods}
        items = [
            p
            for p in json.loads(resp.data)["items"]
            if (p.get("status") or {}).get("phase") == "Running"
            and p["metadata"]["name"] not in seen
            and not p["metadata"].get("deletionTimestamp")
        ]
        if items:
            pod = items[0]
            break
        if plugin.poll() is not None:
            _, err = plugin.communicate()
            pytest.fail(f"kubectl strata verify exited {plugin.returncode} early: {err}")
        time.sleep(0.3)
    if pod is None:
        pods = k8s_cluster.kubectl("get", "pods,jobs", "-n", ns, "-o", "wide")
        events = k8s_cluster.kubectl("get", "events", "-n", ns)
        pytest.fail(f"the verify Job's pod never ran:\n{pods}\n{events}")
    local = kubelet.admit(pod)
    container = local.container("verify")
    argv = list(container["command"])
    assert argv[:2] == ["strata", "verify"]
    mapped = []
    for a in argv[2:]:
        kind, sep, path = a.partition(":")
        if sep and path.startswith("/"):
            a = f"{kind}:{kubelet._map_path(local, container, path)}"
        mapped.append(a)
    proc = kubelet.run(local, "verify", [sys.executable, "-m", "strata.cli", "verify", *mapped])
    code = proc.wait(120)
    if code == 0:
        k8s_cluster.complete_pod(ns, local.name)
    else:
        k8s_cluster.fail_pod(ns, local.name)
    return code


def test_verify_job_runs_strata_verify_where_the_pvc_is_and_passes_its_exit_code_through(
    k8s_cluster: LocalCluster,
    api: client.ApiClient,
    k8s_namespace: str,
    k8s_fake_node: str,
    plugin_env: dict[str, str],
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    job = f"{ns}.train"
    make_policy(api, ns, "fast", [{"jobId": job, "newestCompleteStep": {"pvc": 20}}])
    shm = Path("/dev/shm") / f"strata-e2e-{uuid.uuid4().hex[:8]}"
    kubelet = LocalKubelet(api, tmp_path / "kubelet", shm)
    try:
        pvc_dir = kubelet.pvc_root / "ckpt"
        pvc_dir.mkdir(parents=True)
        setup_pvc(api, ns, pvc_dir)
        pvc = PosixTier(pvc_dir, "pvc")
        write_step([pvc], job, 10, 2)
        write_step([pvc], job, 20, 2)

        for corrupt, want in ((False, 0), (True, 1)):
            if corrupt:
                flip_byte(pvc.data_path(job, 20, 1))
            plugin = subprocess.Popen(
                ["kubectl", "strata", "verify", "job", job, "-n", ns, "--timeout", "120"],
                env=plugin_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                code = _run_verify_pod(k8s_cluster, api, kubelet, ns, plugin)
                _, err = plugin.communicate(timeout=120)
            finally:
                if plugin.poll() is None:
                    plugin.kill()
            assert code == want
            assert plugin.returncode == want, err
            assert "job.batch/strata-verify-" in err
            assert ("every copy intact" in err) if want == 0 else ("exited 1" in err)
            log = kubelet.pods[-1].log_text("verify")
            assert ("4 ok" in log) if want == 0 else ("1 bad copies" in log)
            # Next round gets a fresh pod: remove this Job (and its pods).
            client.BatchV1Api(api).delete_collection_namespaced_job(
                ns,
                label_selector="app.kubernetes.io/name=strata-verify",
                propagation_policy="Background",
            )
            client.CoreV1Api(api).delete_collection_namespaced_pod(
                ns, label_selector="app.kubernetes.io/name=strata-verify", grace_period_seconds=0
            )

        jobs = client.BatchV1Api(api).list_namespaced_job(ns).items
        assert jobs == [] or all(j.metadata.name.startswith("strata-verify-") for j in jobs)
    finally:
        kubelet.close()


def test_version_shows_the_plugin_and_the_operator_the_chart_installs(
    k8s_cluster: LocalCluster, api: client.ApiClient, plugin_env: dict[str, str]
) -> None:
    """The operator Deployment rendered by the chart is found by its labels; its version label
    is shown, and a minor version other than the plugin's is flagged."""
    import yaml

    import strata

    ns = f"strata-ops-{uuid.uuid4().hex[:6]}"
    ensure_namespace(k8s_cluster, ns)
    helm = [str(k8s_cluster.bin_dir / "helm"), "template", "strata", "charts/strata", "-n", ns]
    rendered = subprocess.run(
        [*helm, "--kube-version", "1.35.4"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    (deployment,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
    apps = client.AppsV1Api(api)
    apps.create_namespaced_deployment(ns, deployment)
    try:
        proc = kubectl_strata(plugin_env, "version", "-o", "json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["client"]["version"] == strata.__version__
        (op,) = [o for o in doc["operators"] if o["namespace"] == ns]
        assert op["name"] == deployment["metadata"]["name"] and op["skew"] is False
        assert op["version"] == deployment["metadata"]["labels"]["app.kubernetes.io/version"]
        assert op["image"] == deployment["spec"]["template"]["spec"]["containers"][0]["image"]

        major, minor, *_ = strata.__version__.split(".")
        other = f"{major}.{int(minor) + 1}.0"
        patch = {"metadata": {"labels": {"app.kubernetes.io/version": other}}}
        apps.patch_namespaced_deployment(deployment["metadata"]["name"], ns, patch)
        proc = kubectl_strata(plugin_env, "version")
        assert proc.returncode == 0, proc.stderr
        assert f"operator {ns}/{deployment['metadata']['name']}: {other}" in proc.stdout
        assert "warning: the operator's version" in proc.stdout and "skew" in proc.stdout.lower()
    finally:
        apps.delete_namespaced_deployment(deployment["metadata"]["name"], ns)
