"""The admission webhook through the real kube-apiserver, served by the operator as a subprocess.

Every pod here is created through the apiserver, which calls the operator's webhook over TLS with
the CA bundle the operator wrote into the MutatingWebhookConfiguration; PodSecurity admission
(built into the apiserver) then checks the injected pod where a namespace enforces ``restricted``.
"""

from __future__ import annotations

import json
import random
import statistics
import string
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tests.fixtures.pods import PodBuilder, job_obj, jobset_obj, policy_obj, pytorchjob_obj

from e2e.cluster import LocalCluster
from e2e.operator_fixtures import OPERATOR_NAMESPACE, OperatorProcess, ensure_namespace
from strata.config import StrataConfig
from strata_operator.admission.mutation import (
    INJECTED_ANNOTATION,
    POLICY_LABEL,
    RANK_LABELS,
    SIDECAR_NAME,
)
from strata_operator.api import validation
from strata_operator.reconcile.policy import InvalidSpec, parse_spec

pytestmark = pytest.mark.e2e


def create_policy(api_client: client.ApiClient, namespace: str, **kw: Any) -> dict[str, Any]:
    body = policy_obj(namespace=namespace, **kw)
    created: dict[str, Any] = client.CustomObjectsApi(api_client).create_namespaced_custom_object(
        "strata.dev", "v1alpha1", namespace, "checkpointpolicies", body
    )
    return created


def create_pod(api_client: client.ApiClient, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    core = client.CoreV1Api(api_client)
    created = core.create_namespaced_pod(namespace, pod, _preload_content=False)
    data: dict[str, Any] = json.loads(created.data)
    return data


def denial(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body).get("message", ""))
    except (TypeError, ValueError):
        return str(exc.body or exc.reason)


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (c for c in pod["spec"].get("initContainers") or [] if c["name"] == SIDECAR_NAME), None
    )


def env_names(container: dict[str, Any]) -> set[str]:
    return {e["name"] for e in container.get("env") or []}


def test_labelled_pod_is_injected_and_stays_restricted(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    core = client.CoreV1Api(api)
    core.patch_namespace(
        k8s_namespace,
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    create_policy(api, k8s_namespace, pvc=None)
    pod = create_pod(
        api,
        k8s_namespace,
        PodBuilder("trainer-0", k8s_namespace)
        .policy("fast")
        .label("batch.kubernetes.io/job-name", "pretrain")
        .label("batch.kubernetes.io/job-completion-index", "0")
        .container("train")
        .init_container("fetch")
        .restricted()
        .obj(),
    )
    sidecar = sidecar_of(pod)
    assert sidecar is not None, "the pod was not injected"
    assert sidecar["restartPolicy"] == "Always"
    assert pod["metadata"]["annotations"][INJECTED_ANNOTATION] == "fast"
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch", SIDECAR_NAME]
    train = pod["spec"]["containers"][0]
    config_json = next(e["value"] for e in train["env"] if e["name"] == "STRATA_CONFIG")
    config = StrataConfig.from_env({"STRATA_CONFIG": config_json})
    assert config.job_id == f"{k8s_namespace}.pretrain"
    assert config.report.endpoint == operator_running.report_url
    assert "STRATA_COMPLETION_INDEX" in env_names(train)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    # The restricted namespace's PodSecurity admission accepted the injected pod (it would have
    # refused the create otherwise), and a hostPath RAM tier is refused there with its reason.
    create_policy(api, k8s_namespace, name="hostpath", medium="HostPath", pvc=None)
    with pytest.raises(ApiException) as refused:
        create_pod(
            api,
            k8s_namespace,
            PodBuilder("trainer-1", k8s_namespace)
            .policy("hostpath")
            .container("train")
            .restricted()
            .obj(),
        )
    assert refused.value.status == 403
    assert "hostPath" in denial(refused.value)


def test_workloads_get_the_label_on_every_template(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
    workload_crds: dict[str, str],
) -> None:
    create_policy(api, k8s_namespace)
    custom = client.CustomObjectsApi(api)
    job = client.BatchV1Api(api).create_namespaced_job(
        k8s_namespace, job_obj("pretrain", policy="fast"), _preload_content=False
    )
    job_tmpl = json.loads(job.data)["spec"]["template"]
    assert job_tmpl["metadata"]["labels"][POLICY_LABEL] == "fast"

    js = custom.create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", k8s_namespace, "jobsets", jobset_obj("llm", policy="fast")
    )
    tmpl = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert tmpl["metadata"]["labels"] == {"app": "train", POLICY_LABEL: "fast"}

    pt = custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", k8s_namespace, "pytorchjobs", pytorchjob_obj("bert", policy="fast")
    )
    for rtype in ("Master", "Worker"):
        labels = pt["spec"]["pytorchReplicaSpecs"][rtype]["template"]["metadata"]["labels"]
        assert labels[POLICY_LABEL] == "fast", rtype

    # Workloads without the annotation are not even sent to the webhook (matchConditions).
    plain = client.BatchV1Api(api).create_namespaced_job(
        k8s_namespace, job_obj("plain"), _preload_content=False
    )
    assert POLICY_LABEL not in (
        json.loads(plain.data)["spec"]["template"].get("metadata", {}).get("labels") or {}
    )


def test_missing_policy_is_denied_with_policy_and_namespace(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
) -> None:
    with pytest.raises(ApiException) as pod_err:
        create_pod(
            api, k8s_namespace, PodBuilder("p", k8s_namespace).policy("absent").container("t").obj()
        )
    assert pod_err.value.status == 403
    message = denial(pod_err.value)
    assert "absent" in message and k8s_namespace in message and "create the policy" in message
    with pytest.raises(ApiException) as job_err:
        client.BatchV1Api(api).create_namespaced_job(k8s_namespace, job_obj("j", policy="absent"))
    assert job_err.value.status == 403
    assert "absent" in denial(job_err.value) and k8s_namespace in denial(job_err.value)


# --- 100+ generated odd pod specs -------------------------------------------------------------


def _dns_label(rng: random.Random, n: int) -> str:
    chars = string.ascii_lowercase + string.digits
    body = "".join(rng.choice(chars + "-") for _ in range(max(0, n - 2)))
    return rng.choice(string.ascii_lowercase) + body + rng.choice(chars) if n >= 2 else "a"


def odd_pod(rng: random.Random, i: int, namespace: str) -> tuple[dict[str, Any], str]:
    """One generated pod spec and what is expected: ``inject`` or ``deny:<fragment>``."""
    if rng.random() < 0.2:
        # a huge name: a 253-character DNS subdomain
        name = ".".join(_dns_label(rng, 63) for _ in range(4))[:253].rstrip(".-")
        name = f"{i}-{name}"[:253].rstrip(".-")
        b = PodBuilder(name, namespace)
    elif rng.random() < 0.5:
        b = PodBuilder(None, namespace).generate_name(f"gen-{i}-")
    else:
        b = PodBuilder(f"odd-{i}", namespace)
    expect = "inject"
    roll = rng.random()
    if roll < 0.06:
        b.policy("no-such-policy")
        expect = "deny:not found"
    elif roll < 0.09:
        b.policy("fast").annotation("strata.dev/run-id", "../" + _dns_label(rng, 5))
        expect = "deny:strata.dev/run-id"
    else:
        b.policy(rng.choice(["fast", "lean"]))
    n_containers = rng.choice([1, 1, 2, 3, 4])
    names = set()
    for c in range(n_containers):
        cname = _dns_label(rng, rng.choice([1, 5, 63])) if rng.random() < 0.3 else f"c{c}"
        if cname in names or cname == SIDECAR_NAME:
            cname = f"c{c}x"
        names.add(cname)
        extra: dict[str, Any] = {}
        r = rng.random()
        if r < 0.3:
            extra["resources"] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
        elif r < 0.5:
            extra["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
        # Issue 15: a literal POD_NAME or a mount at Strata's RAM path used to win silently
        # (the trainer then ran with another identity or RAM tier than the sidecar): refused.
        if rng.random() < 0.2:
            extra["env"] = [{"name": "POD_NAME", "value": "mine"}, {"name": "X", "value": "y"}]
            if roll >= 0.09:
                expect = "deny:env POD_NAME"
        if rng.random() < 0.1:
            extra["volumeMounts"] = [{"name": "scratch", "mountPath": "/strata/ram"}]
            if roll >= 0.09:
                expect = "deny:/strata/ram"
        b.container(cname, **extra)
    if any("volumeMounts" in c for c in b.obj()["spec"]["containers"]):
        b.volume("scratch", emptyDir={})
    if roll >= 0.09 and rng.random() < 0.04:
        b.container(SIDECAR_NAME)
        expect = "deny:rename it"
    for k in range(rng.choice([0, 0, 1, 2])):
        if rng.random() < 0.5:
            b.native_sidecar(f"side-{k}")
        else:
            b.init_container(f"init-{k}")
    if rng.random() < 0.2:
        b.spec_field("hostNetwork", True)
    if rng.random() < 0.3:
        b.spec_field("terminationGracePeriodSeconds", rng.choice([0, 5, 30, 600, 3600]))
    for _, label in RANK_LABELS:
        if rng.random() < 0.25:
            b.label(label, str(rng.randint(0, 64)))
    for workload_label in (
        "jobset.sigs.k8s.io/jobset-name",
        "training.kubeflow.org/job-name",
        "batch.kubernetes.io/job-name",
    ):
        if rng.random() < 0.2:
            b.label(workload_label, _dns_label(rng, rng.choice([3, 63])))
    if rng.random() < 0.15:
        b.restricted()
    if rng.random() < 0.1:
        b.annotation("unrelated.example.com/note", "x" * rng.randint(1, 2000))
    return b.obj(), expect


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def test_generated_odd_pods_never_5xx_and_denials_say_why(
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
) -> None:
    create_policy(api, k8s_namespace)
    create_policy(api, k8s_namespace, name="lean", pvc=None, ram_size="64Mi", grace=None)
    rng = random.Random(20261130)
    results: list[tuple[str, int | None, str]] = []
    latencies_injected: list[float] = []
    latencies_plain: list[float] = []
    errors_before = sum(
        v
        for (n, labels), v in operator_running.metrics().items()
        if n == "strata_admission_requests_total" and ("outcome", "error") in labels
    )
    n = 120
    for i in range(n):
        pod, expect = odd_pod(rng, i, k8s_namespace)
        start = time.perf_counter()
        try:
            created = create_pod(api, k8s_namespace, pod)
        except ApiException as exc:
            assert exc.status is not None and exc.status < 500, (
                f"pod #{i}: {exc.status} {denial(exc)}"
            )
            message = denial(exc)
            assert expect.startswith("deny:"), f"pod #{i} refused unexpectedly: {message}"
            assert expect.removeprefix("deny:") in message, (i, message)
            assert "denied the request" in message, message
            assert "Strata: " in message, message
            results.append((expect, exc.status, message))
            continue
        latencies_injected.append(time.perf_counter() - start)
        assert not expect.startswith("deny:"), f"pod #{i} should have been refused ({expect})"
        sidecar = sidecar_of(created)
        assert sidecar is not None, f"pod #{i} not injected"
        for c in created["spec"]["containers"]:
            assert "STRATA_CONFIG" in env_names(c), (i, c["name"])
        names = [c["name"] for c in pod["spec"].get("initContainers") or []]
        assert [c["name"] for c in created["spec"]["initContainers"]] == [*names, SIDECAR_NAME]
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        policy_grace = 120 if pod["metadata"]["labels"][POLICY_LABEL] == "fast" else 0
        assert created["spec"]["terminationGracePeriodSeconds"] == max(grace, policy_grace)
        if pod["spec"].get("hostNetwork"):
            assert "ports" not in sidecar
        results.append((expect, None, ""))
    # The same kind of pods without the label never reach the webhook: the baseline.
    for i in range(40):
        start = time.perf_counter()
        create_pod(api, k8s_namespace, PodBuilder(f"plain-{i}", k8s_namespace).container("c").obj())
        latencies_plain.append(time.perf_counter() - start)

    denied = [r for r in results if r[1] is not None]
    assert len(results) == n and 0 < len(denied) < n
    assert operator_running.alive(), operator_running.log_tail()
    errors_after = sum(
        v
        for (name, labels), v in operator_running.metrics().items()
        if name == "strata_admission_requests_total" and ("outcome", "error") in labels
    )
    assert errors_after == errors_before
    samples = operator_running.metrics()
    handler_sum = samples.get(("strata_admission_duration_seconds_sum", (("kind", "Pod"),)), 0.0)
    handler_count = samples.get(
        ("strata_admission_duration_seconds_count", (("kind", "Pod"),)), 0.0
    )
    p50, p99 = _percentile(latencies_injected, 0.5), _percentile(latencies_injected, 0.99)
    b50, b99 = _percentile(latencies_plain, 0.5), _percentile(latencies_plain, 0.99)
    print(
        f"\n[admission] {n} generated pods: {n - len(denied)} injected, {len(denied)} denied; "
        f"create latency with webhook p50 {p50 * 1000:.1f} ms p99 {p99 * 1000:.1f} ms; "
        f"without (unlabelled) p50 {b50 * 1000:.1f} ms p99 {b99 * 1000:.1f} ms; "
        f"webhook overhead p50 {(p50 - b50) * 1000:.1f} ms; "
        f"mean create {statistics.fmean(latencies_injected) * 1000:.1f} ms; operator handler "
        f"mean {handler_sum / max(handler_count, 1) * 1000:.1f} ms over {handler_count:.0f} reviews"
    )


# --- C-10 and C-11 ------------------------------------------------------------------------------


def test_c10_operator_stopped_failure_policy_fail_and_ignore(
    strata_operator: OperatorProcess,
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
) -> None:
    create_policy(api, k8s_namespace, pvc=None)
    ensure_namespace(k8s_cluster, OPERATOR_NAMESPACE)
    strata_operator.stop()

    # kube-system and the operator's namespace never depend on the webhook, even when labelled.
    for ns in ("kube-system", OPERATOR_NAMESPACE):
        pod = create_pod(
            api, ns, PodBuilder(None, ns).generate_name("c10-").policy("fast").container("c").obj()
        )
        assert sidecar_of(pod) is None
        client.CoreV1Api(api).delete_namespaced_pod(pod["metadata"]["name"], ns)

    # failurePolicy Fail: a training pod is refused, and the message names the webhook.
    with pytest.raises(ApiException) as refused:
        create_pod(
            api,
            k8s_namespace,
            PodBuilder("t-fail", k8s_namespace).policy("fast").container("c").obj(),
        )
    message = denial(refused.value)
    assert "inject-pods.strata.dev" in message and "failed calling webhook" in message, message

    # failurePolicy Ignore: written by the operator, then the operator stops again.
    strata_operator.start(["--failure-policy=Ignore"])
    strata_operator.stop()
    pod = create_pod(
        api,
        k8s_namespace,
        PodBuilder("t-ignore", k8s_namespace).policy("fast").container("c").obj(),
    )
    assert sidecar_of(pod) is None  # created uninjected...
    strata_operator.start(["--failure-policy=Ignore"])
    # ...and reported as unprotected once the operator is back: an Event on the pod.
    deadline = time.monotonic() + 30
    reasons: list[str] = []
    while time.monotonic() < deadline:
        events = client.CoreV1Api(api).list_namespaced_event(
            k8s_namespace, field_selector="involvedObject.name=t-ignore"
        )
        reasons = [e.reason for e in events.items]
        if "NotProtected" in reasons:
            break
        time.sleep(0.5)
    assert "NotProtected" in reasons, strata_operator.log_tail()
    assert strata_operator.metric("strata_pods_uninjected_total") >= 1


def test_c11_restart_with_a_new_certificate_keeps_pod_creation_working(
    strata_operator: OperatorProcess,
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
) -> None:
    create_policy(api, k8s_namespace, pvc=None)
    old_ca = strata_operator.ca_file.read_bytes()
    assert strata_operator.ca_bundle_in_cluster() == old_ca
    strata_operator.restart()
    new_ca = strata_operator.ca_file.read_bytes()
    assert new_ca != old_ca
    # The configuration was updated before the new server accepted a request: the very first
    # pods after the restart are injected (an old caBundle would fail them with x509 errors).
    assert strata_operator.ca_bundle_in_cluster() == new_ca
    for i in range(5):
        pod = create_pod(
            api,
            k8s_namespace,
            PodBuilder(f"after-restart-{i}", k8s_namespace).policy("fast").container("c").obj(),
        )
        assert sidecar_of(pod) is not None


# --- issue 15: pods that cannot be injected, reinvocation, pod-level resources ----------------


def _admissions(op: OperatorProcess, outcome: str) -> float:
    return op.metric("strata_admission_requests_total", kind="Pod", outcome=outcome)


def test_colliding_and_windows_pods_are_refused_by_strata_with_what_to_change(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    """Before, these were injected silently with the user's object winning (a hostPath named
    strata-ram became the RAM tier), or refused by the apiserver with no word of Strata."""
    ns = k8s_namespace
    create_policy(api, ns, pvc=None)

    def pod(name: str) -> PodBuilder:
        return PodBuilder(name, ns).policy("fast").container("train")

    cases: list[tuple[dict[str, Any], list[str]]] = [
        (pod("init-named").init_container(SIDECAR_NAME).obj(), ["init container", "rename it"]),
        (pod("vol").volume("strata-ram", hostPath={"path": "/tmp/x"}).obj(), ["strata-ram"]),
        (
            PodBuilder("envc", ns)
            .policy("fast")
            .container("train", env=[{"name": "STRATA_CONFIG", "value": "{}"}])
            .obj(),
            ["STRATA_CONFIG"],
        ),
        (
            PodBuilder("port", ns)
            .policy("fast")
            .container("train", ports=[{"containerPort": 9464}])
            .obj(),
            ["9464"],
        ),
        (pod("annot").annotation(INJECTED_ANNOTATION, "fast").obj(), [INJECTED_ANNOTATION]),
        (pod("windows").spec_field("os", {"name": "windows"}).obj(), ["windows"]),
        (pod("huge").annotation("example.com/blob", "x" * (256 * 1024 - 64)).obj(), ["256 KiB"]),
    ]
    for obj, fragments in cases:
        name = obj["metadata"]["name"]
        with pytest.raises(ApiException) as err:
            create_pod(api, ns, obj)
        message = denial(err.value)
        assert err.value.status == 422, (name, err.value.status, message)
        assert "Strata: " in message, (name, message)
        for fragment in fragments:
            assert fragment in message, (name, message)


def test_pod_level_resources_are_raised_so_the_apiserver_accepts_the_pod(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    create_policy(api, ns, pvc=None, ram_size="1Gi")
    obj = (
        PodBuilder("podlevel", ns)
        .policy("fast")
        .container("train", resources={"requests": {"cpu": "1", "memory": "1Gi"}})
        .spec_field(
            "resources", {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
        )
        .obj()
    )
    created = create_pod(api, ns, obj)
    assert sidecar_of(created) is not None
    pod_level = created["spec"]["resources"]
    assert pod_level["requests"]["cpu"] == "2250m"
    assert validation.quantity_bytes(pod_level["limits"]["memory"]) > 4 * 2**30


def test_reinvocation_does_no_work_one_injection_per_pod(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    """The apiserver calls the webhook again after the ServiceAccount plugin mounted a token
    into the new sidecar; that second call finds the pod injected and returns at once (before:
    it read the policy and rebuilt the patch, counted as "unchanged")."""
    ns = k8s_namespace
    create_policy(api, ns, pvc=None)
    before = {o: _admissions(operator_running, o) for o in ("injected", "unchanged", "reinvoked")}
    for i in range(3):
        created = create_pod(
            api, ns, PodBuilder(f"once-{i}", ns).policy("fast").container("t").obj()
        )
        assert sidecar_of(created) is not None
    after = {o: _admissions(operator_running, o) for o in before}
    assert after["injected"] - before["injected"] == 3
    assert after["unchanged"] == before["unchanged"]
    assert after["reinvoked"] - before["reinvoked"] in (0, 3)


def _policy_reads(op: OperatorProcess, source: str) -> float:
    return op.metric("strata_admission_policy_reads_total", source=source)


def _set_sidecar_image(api_client: client.ApiClient, ns: str, policy: str, image: str) -> None:
    client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
        "strata.dev",
        "v1alpha1",
        ns,
        "checkpointpolicies",
        policy,
        {"spec": {"sidecar": {"image": image}}},
    )


def _dry_run_pod(
    api_client: client.ApiClient, ns: str, name: str, policy: str = "fast"
) -> dict[str, Any]:
    """A pod created with ``dryRun=All``: admitted (webhook included) but not stored."""
    pod = PodBuilder(name, ns).policy(policy).container("t").obj()
    answered = client.CoreV1Api(api_client).create_namespaced_pod(
        ns, pod, dry_run="All", _preload_content=False
    )
    data: dict[str, Any] = json.loads(answered.data)
    return data


def test_admission_reads_the_policy_from_the_watch_and_follows_updates_and_deletes(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    """The webhook serves policies from the operator's own watch (no GET per pod: at 1,000
    pods the GETs queued admissions for seconds), and that copy follows a spec change and a
    deletion."""
    ns = k8s_namespace
    create_policy(api, ns, pvc=None, image="strata:one")
    deadline = time.monotonic() + 30
    cached = _policy_reads(operator_running, "cache")
    while _policy_reads(operator_running, "cache") == cached:  # until the watch delivered it
        assert time.monotonic() < deadline, "the policy never reached the webhook's cache"
        assert sidecar_of(_dry_run_pod(api, ns, "probe")) is not None
        time.sleep(0.2)
    gets = _policy_reads(operator_running, "api")
    cached = _policy_reads(operator_running, "cache")
    for i in range(3):
        assert sidecar_of(
            create_pod(api, ns, PodBuilder(f"w-{i}", ns).policy("fast").container("t").obj())
        )
    assert _policy_reads(operator_running, "api") == gets, "a cached policy was read with a GET"
    assert _policy_reads(operator_running, "cache") - cached == 3

    _set_sidecar_image(api, ns, "fast", "strata:two")
    deadline = time.monotonic() + 30
    while (sidecar_of(_dry_run_pod(api, ns, "probe")) or {}).get("image") != "strata:two":
        assert time.monotonic() < deadline, "the webhook kept the policy's old spec"
        time.sleep(0.2)

    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", "fast"
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            _dry_run_pod(api, ns, "probe")
        except ApiException as exc:
            assert exc.status == 403 and "not found" in denial(exc)
            break
        assert time.monotonic() < deadline, "the webhook kept admitting with a deleted policy"
        time.sleep(0.2)


def test_the_policy_cache_starts_over_after_an_operator_restart(
    strata_operator: OperatorProcess,
    operator_running: OperatorProcess,
    api: client.ApiClient,
    k8s_namespace: str,
) -> None:
    """The webhook's copy of the policies lives in the operator process. A policy changed and
    one deleted while the operator was down are served as they are now from the first pod after
    its restart (a miss before the watch's initial listing falls back to a GET), never as they
    were; once the listing has filled the cache, pods are admitted without a GET."""
    ns = k8s_namespace
    create_policy(api, ns, pvc=None, image="strata:one")
    create_policy(api, ns, name="gone", pvc=None, image="strata:gone")
    for name in ("fast", "gone"):
        deadline = time.monotonic() + 30
        while (sidecar_of(_dry_run_pod(api, ns, "probe", name)) or {}).get("image") is None:
            assert time.monotonic() < deadline, f"policy {name} never admitted a pod"
            time.sleep(0.2)
    strata_operator.stop()
    _set_sidecar_image(api, ns, "fast", "strata:two")
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        "strata.dev", "v1alpha1", ns, "checkpointpolicies", "gone"
    )
    strata_operator.start(strata_operator.args)

    assert (sidecar_of(_dry_run_pod(api, ns, "first")) or {}).get("image") == "strata:two"
    with pytest.raises(ApiException) as denied:
        _dry_run_pod(api, ns, "orphan", "gone")
    assert denied.value.status == 403 and "not found" in denial(denied.value)

    deadline = time.monotonic() + 30
    while _policy_reads(strata_operator, "cache") == 0:  # the listing reached the cache
        assert time.monotonic() < deadline, "the restarted operator's cache never filled"
        assert (sidecar_of(_dry_run_pod(api, ns, "probe")) or {}).get("image") == "strata:two"
        time.sleep(0.2)
    gets = _policy_reads(strata_operator, "api")
    for i in range(3):
        pod = create_pod(api, ns, PodBuilder(f"after-{i}", ns).policy("fast").container("t").obj())
        assert (sidecar_of(pod) or {}).get("image") == "strata:two"
    assert _policy_reads(strata_operator, "api") == gets, "a cached policy was read with a GET"


# --- issue 15: property: what the model accepts, the apiserver accepts (policy AND patched pod)


_SIZE_SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E", "m"]
_EXPONENTS = ["e3", "e-3", "E2", "e400", "e9"]
_numbers = st.one_of(
    st.integers(-5, 10**7).map(str),
    st.sampled_from(["0", "1", "1.5", ".5", "0.001", "99999999999999999999"]),
)
quantities = st.one_of(
    st.builds(lambda n, s: n + s, _numbers, st.sampled_from(_SIZE_SUFFIXES + _EXPONENTS)),
    st.sampled_from(["1Mi", "64Mi", "2Gi", "32Ti", "33Ti", "1Ei", "2E", "1e400", "1e1.5", "8Ei"]),
    st.integers(-3, 2**40),
)
durations = st.one_of(
    st.builds(
        lambda n, u: f"{n}{u}",
        st.integers(0, 10**13),
        st.sampled_from(["ns", "us", "ms", "s", "m", "h"]),
    ),
    st.sampled_from(["1h30m", "2562047h", "2562048h", "1.5s", "15m"]),
)
_path_chars = st.sampled_from([*"ab/.-_é", "\x00", "\r", "\n", " ", "/"])
host_paths = st.one_of(
    st.sampled_from(
        [
            *("/dev/shm/strata", "/", "/etc", "/proc/x", "/dev", "/dev/sda", "/var/lib/kubelet"),
            *("/mnt/fast", "/dev/shm/../etc", "/dev/shm/"),
        ]
    ),
    st.text(_path_chars, min_size=1, max_size=12).map(lambda t: "/" + t),
)
prefixes = st.one_of(
    st.sampled_from(["", "llm", "teams/llm", "a/./b", "..", "a//b", "é" * 130]),
    st.text(_path_chars, max_size=16),
)
images = st.sampled_from(
    [
        *("ghcr.io/strata-dev/strata:0.1.0", "strata:e2e", "UPPER/x", "x:bad:tag"),
        *("a.io/x@sha256:abc", "localhost:5000/s/t:v1", "x" * 300),
    ]
)
resource_names = st.sampled_from(
    [
        *("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu", "hugepages-2Mi", "gpu"),
        *("kubernetes.io/x", "example.com/fpga"),
    ]
)
resource_lists = st.dictionaries(resource_names, quantities, max_size=3)


def _mostly(draw: st.DrawFn, tame: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
    """A value from ``tame`` (meant to be valid) 85 % of the time, else from ``wild``."""
    return draw(tame if draw(st.integers(0, 99)) < 85 else wild)


@st.composite
def policy_specs(draw: st.DrawFn) -> dict[str, Any]:
    ram: dict[str, Any] = {
        "sizeLimit": _mostly(
            draw, st.sampled_from(["1Mi", "64Mi", "512Mi", "2Gi", "32Ti"]), quantities
        ),
        "keep": _mostly(draw, st.integers(1, 16), st.integers(-1, 17)),
    }
    if draw(st.booleans()):
        ram["medium"] = "HostPath"
        if draw(st.booleans()):
            ram["hostPath"] = _mostly(
                draw, st.sampled_from(["/dev/shm/strata", "/mnt/fast"]), host_paths
            )
    tiers: dict[str, Any] = {"ram": ram}
    if draw(st.booleans()):
        every: dict[str, Any] = {"steps": _mostly(draw, st.integers(1, 1000), st.integers(-1, 0))}
        if draw(st.booleans()):
            every["duration"] = _mostly(draw, st.sampled_from(["1h", "90s", "15m"]), durations)
        tiers["pvc"] = {"claimName": "ckpt", "every": every}
    if draw(st.booleans()):
        tiers["gcs"] = {
            "bucket": "strata-ckpts",
            "prefix": _mostly(draw, st.sampled_from(["", "llm", "teams/llm"]), prefixes),
            "every": {"steps": 1000},
        }
    sidecar: dict[str, Any] = {}
    if draw(st.booleans()):
        tame_resources = st.fixed_dictionaries(
            {},
            optional={
                "cpu": st.sampled_from(["100m", "1", "2"]),
                "memory": st.sampled_from(["256Mi", "1Gi"]),
            },
        )
        sidecar["resources"] = {
            "requests": _mostly(draw, tame_resources, resource_lists),
            "limits": _mostly(draw, tame_resources, resource_lists),
        }
    if draw(st.booleans()):
        sidecar["image"] = _mostly(
            draw, st.sampled_from(["ghcr.io/strata-dev/strata:0.1.0"]), images
        )
    if draw(st.booleans()):
        sidecar["terminationGracePeriodSeconds"] = _mostly(
            draw, st.integers(1, 86400), st.integers(-1, 90000)
        )
    if draw(st.booleans()):
        sidecar["ports"] = {
            "metrics": _mostly(draw, st.integers(1024, 65535), st.sampled_from([80, 70000]))
        }
    return {"tiers": tiers, "sidecar": sidecar}


def _model_accepts(spec: dict[str, Any]) -> bool:
    try:
        parse_spec(spec)
    except InvalidSpec:
        return False
    return True


def test_property_a_policy_the_model_accepts_injects_pods_the_apiserver_accepts(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    """Generated policies (edge quantities, durations, resources, paths, prefixes, images): if
    the model accepts one, the apiserver stores it and accepts the injected representative pod
    (server-side dry run through the real webhook); if the apiserver stores one, the webhook
    answers it with an injection or a "Strata:" refusal, never a 5xx."""
    ns = k8s_namespace
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    seen = {"model": 0, "api": 0, "both": 0, "n": 0}

    @settings(
        max_examples=120,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(spec=policy_specs())
    def check(spec: dict[str, Any]) -> None:
        seen["n"] += 1
        name = f"prop-{seen['n']}"
        model_ok = _model_accepts(spec)
        body = {
            "apiVersion": "strata.dev/v1alpha1",
            "kind": "CheckpointPolicy",
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        }
        try:
            custom.create_namespaced_custom_object(
                "strata.dev", "v1alpha1", ns, "checkpointpolicies", body, field_validation="Strict"
            )
        except ApiException as exc:
            assert exc.status in (400, 422), (exc.status, exc.body)
            assert not model_ok, f"the model accepts what the apiserver refuses: {denial(exc)}"
            return
        seen["api"] += 1
        seen["model"] += model_ok
        pod = (
            PodBuilder(f"rep-{seen['n']}", ns)
            .policy(name)
            .label("batch.kubernetes.io/job-name", "pretrain")
            .label("batch.kubernetes.io/job-completion-index", "0")
            .container("train", resources={"requests": {"cpu": "1", "memory": "1Gi"}})
            .init_container("fetch")
            .obj()
        )
        try:
            try:
                created = core.create_namespaced_pod(ns, pod, dry_run="All", _preload_content=False)
            except ApiException as exc:
                message = denial(exc)
                assert exc.status is not None and exc.status < 500, (exc.status, message)
                assert "Strata: " in message, message
                assert not model_ok, f"model-accepted policy {spec!r}: pod refused: {message}"
                return
            assert model_ok, f"a policy the model refuses injected a pod: {spec!r}"
            seen["both"] += 1
            assert sidecar_of(json.loads(created.data)) is not None
        finally:
            custom.delete_namespaced_custom_object(
                "strata.dev", "v1alpha1", ns, "checkpointpolicies", name
            )

    check()
    print(f"\n[property] {seen}")
    assert seen["both"] >= 10, seen  # the generator reaches valid policies too
