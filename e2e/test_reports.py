"""The report receiver through real tokens: TokenRequest-issued pod-bound tokens, a real
TokenReview by the apiserver, the operator as a subprocess, status and Events read back."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client, watch
from tests.fixtures.pods import PodBuilder, policy_obj

from e2e.cluster import LocalCluster
from e2e.operator_fixtures import OperatorProcess
from strata.reports import (
    REPORT_PATH,
    FlushEstimate,
    ReportedError,
    Restore,
    SidecarReport,
    TierState,
)

pytestmark = pytest.mark.e2e

AUDIENCE = "strata.dev"


@pytest.fixture
def other_namespace(k8s_cluster: LocalCluster) -> Iterator[str]:
    name = f"reports-other-{uuid.uuid4().hex[:6]}"
    k8s_cluster.request(
        "/api/v1/namespaces",
        "POST",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    try:
        yield name
    finally:
        k8s_cluster.request(f"/api/v1/namespaces/{name}", "DELETE")


def make_pod(api_client: client.ApiClient, ns: str, name: str, policy: str | None) -> None:
    b = PodBuilder(name, ns).container("train")
    if policy:
        b.policy(policy)
    client.CoreV1Api(api_client).create_namespaced_pod(ns, b.obj())


def pod_token(api_client: client.ApiClient, ns: str, pod: str, audience: str = AUDIENCE) -> str:
    """A projected-style token bound to ``pod`` (what the kubelet mounts), via TokenRequest."""
    core = client.CoreV1Api(api_client)
    uid = core.read_namespaced_pod(pod, ns).metadata.uid
    for _ in range(100):
        try:
            core.read_namespaced_service_account("default", ns)
            break
        except client.exceptions.ApiException:
            import time

            time.sleep(0.1)
    resp = core.create_namespaced_service_account_token(
        "default",
        ns,
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience],
                "expirationSeconds": 600,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid},
            },
        },
    )
    return str(resp.status.token)


def post(op: OperatorProcess, body: bytes, token: str | None) -> tuple[int, dict[str, Any]]:
    context = ssl.create_default_context(cafile=str(op.ca_file))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(op.report_url + REPORT_PATH, data=body, headers=headers)
    try:
        with opener.open(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def report(ns: str, pod: str, **kw: Any) -> SidecarReport:
    return SidecarReport(policy="fast", namespace=ns, pod_name=pod, job_id=f"{ns}.train", **kw)


def policy_status(api_client: client.ApiClient, ns: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", "fast"
    )
    return dict(obj.get("status") or {})


def events_of(api_client: client.ApiClient, ns: str, name: str) -> list[Any]:
    return list(
        client.CoreV1Api(api_client)
        .list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
        .items
    )


def test_good_report_shows_in_status_and_an_event(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
) -> None:
    ns = k8s_namespace
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", policy_obj(namespace=ns, pvc=None)
    )
    make_pod(api, ns, "train-0", "fast")
    token = pod_token(api, ns, "train-0")
    received = operator_running.metric("strata_reports_received_total")
    restored_at = datetime.now(UTC) - timedelta(seconds=5)
    good = report(
        ns,
        "train-0",
        tiers={
            "ram": TierState(newest_complete_step=40, complete_steps=1),
            "pvc": TierState(newest_complete_step=30, complete_steps=2),
        },
        restores=[Restore(tier="pvc", step=30, bytes=4096, seconds=0.25, rank=0, time=restored_at)],
        errors=[ReportedError(tier="gcs", message="bucket unreachable: timeout")],
    )
    status, answer = post(operator_running, good.model_dump_json().encode(), token)
    assert status == 202, answer
    st = policy_status(api, ns)
    job = st["jobs"][0]
    assert job["jobId"] == f"{ns}.train"
    assert job["newestCompleteStep"] == {"ram": 40, "pvc": 30}
    assert job["lastRestore"]["tier"] == "pvc" and job["lastRestore"]["step"] == 30
    assert job["lastRestore"]["seconds"] == 0.25
    assert job["lastError"]["tier"] == "gcs"
    assert st["newestCompleteStep"] == {"ram": 40, "pvc": 30}
    reasons = [e.reason for e in events_of(api, ns, "fast")]
    assert reasons.count("Restored") == 1 and reasons.count("TierFailed") == 1
    restored = next(e for e in events_of(api, ns, "fast") if e.reason == "Restored")
    assert "step 30 from tier pvc" in restored.message
    # Re-sent (the sidecar retries): folded again, but no second event for the same restore.
    status, _ = post(operator_running, good.model_dump_json().encode(), token)
    assert status == 202
    assert [e.reason for e in events_of(api, ns, "fast")].count("Restored") == 1
    assert operator_running.metric("strata_reports_received_total") == received + 2
    table = k8s_cluster.kubectl("get", "ckpol", "-n", ns)
    print("\n" + table)
    assert "40" in table and "30" in table


def wait_ready(api_client: client.ApiClient, ns: str, timeout: float = 120.0) -> None:
    """Until the reconcile set Ready (its conditions write then no longer races the receiver's)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conds = policy_status(api_client, ns).get("conditions") or []
        if any(cond.get("type") == "Ready" for cond in conds):
            return
        time.sleep(0.2)
    raise AssertionError(f"policy {ns}/fast not reconciled within {timeout}s")


def test_flush_estimates_become_a_condition_and_a_warning_older_sidecars_still_report(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
) -> None:
    ns = k8s_namespace
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", policy_obj(namespace=ns, pvc=None)
    )
    make_pod(api, ns, "train-0", "fast")
    token = pod_token(api, ns, "train-0")
    wait_ready(api, ns)
    # A sidecar of an older version: no `flush` key at all.
    old = report(ns, "train-0", tiers={"ram": TierState(newest_complete_step=10)})
    body = json.loads(old.model_dump_json())
    del body["flush"]
    status, answer = post(operator_running, json.dumps(body).encode(), token)
    assert status == 202, answer
    st = policy_status(api, ns)
    assert "flush" not in st["jobs"][0]
    assert not [x for x in st.get("conditions", []) if x["type"] == "FlushFitsGracePeriod"]

    def flush(needed: float) -> FlushEstimate:
        return FlushEstimate(
            tier="gcs",
            state_bytes=2**30,
            bytes_per_second=2**30 / needed,
            seconds_needed=needed,
            grace_seconds=30.0,
            budget_seconds=25.0,
            fits=needed <= 25.0,
        )

    fits = report(ns, "train-0", flush=flush(5.0))
    status, answer = post(operator_running, fits.model_dump_json().encode(), token)
    assert status == 202, answer
    st = policy_status(api, ns)
    assert st["jobs"][0]["flush"]["secondsNeeded"] == 5.0
    cond = next(x for x in st["conditions"] if x["type"] == "FlushFitsGracePeriod")
    assert (cond["status"], cond["reason"]) == ("True", "FlushFits")
    assert any(x["type"] == "Ready" for x in st["conditions"])  # the reconcile's are kept

    slow = report(ns, "train-0", flush=flush(80.0))
    status, answer = post(operator_running, slow.model_dump_json().encode(), token)
    assert status == 202, answer
    st = policy_status(api, ns)
    job = st["jobs"][0]
    assert (job["flush"]["fits"], job["flush"]["graceSeconds"]) == (False, 30.0)
    cond = next(x for x in st["conditions"] if x["type"] == "FlushFitsGracePeriod")
    assert (cond["status"], cond["reason"]) == ("False", "FlushTooSlow")
    print("\n" + cond["message"])
    warnings = [e for e in events_of(api, ns, "fast") if e.reason == "FlushTooSlow"]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    assert "terminationGracePeriodSeconds to at least 85" in warnings[0].message


def test_bad_reports_are_rejected_and_counted(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    other_namespace: str,
) -> None:
    ns = k8s_namespace
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", policy_obj(namespace=ns, pvc=None)
    )
    make_pod(api, ns, "train-0", "fast")
    make_pod(api, ns, "train-1", "fast")
    make_pod(api, ns, "unlabelled", None)
    make_pod(api, other_namespace, "intruder", None)
    token = pod_token(api, ns, "train-0")
    body = report(ns, "train-0", tiers={"ram": TierState(newest_complete_step=1)})

    def rejected(reason: str) -> float:
        return operator_running.metric("strata_reports_rejected_total", reason=reason)

    cases: list[tuple[str, int, bytes, str | None]] = [
        ("missing-token", 401, body.model_dump_json().encode(), None),
        ("bad-token", 401, body.model_dump_json().encode(), "not-a-token"),
        (
            "bad-token",
            401,
            body.model_dump_json().encode(),
            pod_token(api, ns, "train-0", audience="someone-else"),
        ),
        ("malformed", 400, b"{not json", token),
        ("malformed", 400, json.dumps({**body.model_dump(mode="json"), "x": 1}).encode(), token),
        (
            "namespace-mismatch",
            403,
            body.model_dump_json().encode(),
            pod_token(api, other_namespace, "intruder"),
        ),
        ("pod-mismatch", 403, body.model_dump_json().encode(), pod_token(api, ns, "train-1")),
        (
            "policy-mismatch",
            403,
            report(ns, "unlabelled").model_dump_json().encode(),
            pod_token(api, ns, "unlabelled"),
        ),
    ]
    for reason, code, payload, tok in cases:
        before = rejected(reason)
        status, answer = post(operator_running, payload, tok)
        assert status == code, (reason, status, answer)
        assert answer["error"] == reason and answer["message"], answer
        assert rejected(reason) == before + 1, reason
    assert not policy_status(api, ns).get("jobs")
    # The same token with a correct body is accepted: the rejections were about the input.
    status, _ = post(operator_running, body.model_dump_json().encode(), token)
    assert status == 202
    assert policy_status(api, ns)["jobs"][0]["newestCompleteStep"] == {"ram": 1}


def test_concurrent_reports_are_folded_into_few_status_writes(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    """Issue 15: 20 ranks x 10 reports, ranks in parallel. Before, every report was one status
    patch (200 writes, one policy at a time); now the reports queued for a policy are folded
    into one patch per interval. Counted as the policy's MODIFIED watch events."""
    ns = k8s_namespace
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", policy_obj(namespace=ns, pvc=None)
    )
    ranks, per_rank = 20, 10
    tokens = {}
    for r in range(ranks):
        make_pod(api, ns, f"rank-{r}", "fast")
    for r in range(ranks):
        tokens[r] = pod_token(api, ns, f"rank-{r}")
    start_rv = custom.get_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", "fast"
    )["metadata"]["resourceVersion"]

    def rank(r: int) -> list[int]:
        codes = []
        for i in range(1, per_rank + 1):
            body = SidecarReport(
                policy="fast",
                namespace=ns,
                pod_name=f"rank-{r}",
                job_id=f"{ns}.job-{r}",
                tiers={"ram": TierState(newest_complete_step=i * 10)},
            )
            codes.append(post(operator_running, body.model_dump_json().encode(), tokens[r])[0])
        return codes

    with ThreadPoolExecutor(ranks) as pool:
        codes = [c for rank_codes in pool.map(rank, range(ranks)) for c in rank_codes]
    assert codes == [202] * ranks * per_rank

    status = policy_status(api, ns)
    steps = {j["jobId"]: j["newestCompleteStep"]["ram"] for j in status["jobs"]}
    assert steps == {f"{ns}.job-{r}": per_rank * 10 for r in range(ranks)}
    writes = 0
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        "strata.dev",
        "v1alpha1",
        ns,
        "checkpointpolicies",
        resource_version=start_rv,
        timeout_seconds=5,
    )
    for event in stream:
        if event["type"] == "MODIFIED":
            writes += 1
    print(f"\n[reports] {ranks * per_rank} reports -> {writes} status writes")
    assert writes <= ranks * per_rank // 4, writes
