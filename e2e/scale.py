"""``make scale``: the operator at 1,000 ranks on the local control plane (not part of make test).

What runs, all real: the control plane of `e2e.cluster` with ``--nodes`` kwok nodes, the Strata
operator as a subprocess (`e2e.operator_fixtures.OperatorProcess`), the JobSet controller with its
webhooks (`e2e.workloads.JobSetController`), and one JobSet of ``--jobs`` child Jobs whose pods
add up to ``--pods``, created by the JobSet and Job controllers, injected by the Strata webhook,
scheduled and run by kwok. Then one simulated sidecar per pod reports the way
``strata.agent.reporter`` does (``POST <endpoint>/v1/reports``, a :class:`strata.reports.
SidecarReport` body, a projected-style service-account token bound to that pod for the report
audience, the operator's CA, a new TLS connection per attempt, the reporter's default timeout per
attempt and retries with backoff), every sidecar once per ``--interval`` seconds, staggered
evenly, for ``--rounds`` rounds; the step grows every round.

Measured (all printed, and written as JSON to ``--out``, default e2e/results/scale-latest.json):

* webhook: the operator's handler time of Pod admissions (histogram
  ``strata_admission_duration_seconds``, p50/p99 interpolated within its buckets) and the
  apiserver's round trip to that webhook (``apiserver_admission_webhook_admission_duration_
  seconds``), admission reviews per pod;
* pods: JobSet created -> all pods Running (seconds);
* receiver: latency seen by the sidecars (exact p50/p99: first attempts, and accepted reports end
  to end), attempts, final statuses, per round;
* status convergence: from the last round's first report, and from its last answered report,
  until ``status.jobs[<job>].newestCompleteStep.ram`` shows the last round's step;
* operator process: RSS (MiB, sampled every 0.5 s: at start, peak, end of each phase) and CPU
  (seconds and percent of one core per phase).

* operator RSS before the workload, its peak over the whole run, and ``--settle`` seconds (60)
  after the last report (or the last admission with ``--rounds 0``): what the operator keeps.

The large jobs (admission only, ``--rounds 0``): ``--workload indexed-job --pods 20000`` is one
Indexed Job of 20,000 pods (no JobSet); ``--workload jobset --peers --pods 4096 --jobs 1`` is one
JobSet of 4,096 pods under a policy with ``spec.peers``, the most the peer tier takes
(``strata_operator.admission.peers.MAX_PEERS``; every pod's configuration carries the peers as
name patterns, not as a list). ``make scale`` runs the report run
and then both of these (``make scale-large`` only the latter).

The figures depend on the machine and on whatever else runs on it; the JSON records the CPU
count and load averages at start and end.

Usage: ``python -m e2e.scale [--nodes 1000] [--pods 1000] [--jobs 10] [--rounds 3]
[--interval 10] [--workload jobset|indexed-job] [--peers] [--settle 60] [--dir .strata-run/scale]
[--out e2e/results/scale-latest.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import REPO_ROOT, LocalCluster
from e2e.operator_fixtures import OPERATOR_NAMESPACE, OperatorProcess, apply_crds, ensure_namespace
from e2e.workloads import JobSetController, locate_jobset
from strata.config import ReportConfig
from strata.reports import REPORT_PATH, SidecarReport, TierState
from strata_operator.admission.mutation import POLICY_LABEL, TOKEN_VOLUME

NAMESPACE = "scale"
POLICY = "fast"
JOBSET = "big"


# --------------------------------------------------------------------------- measurements


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of exact samples; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def histogram(text: str, metric: str, **match: str) -> dict[str, Any]:
    """Count, p50, p99 (linear interpolation within buckets, like PromQL histogram_quantile) and
    mean of the histogram ``metric`` in Prometheus text, summed over series whose labels contain
    every ``match`` item as a substring."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != metric:
            continue
        for s in family.samples:
            if not all(v in s.labels.get(k, "") for k, v in match.items()):
                continue
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value

    def quantile(q: float) -> float | None:
        if count == 0:
            return None
        rank, prev_le, prev_n = q * count, 0.0, 0.0
        for le in sorted(buckets):
            n = buckets[le]
            if n >= rank:
                if le == float("inf"):
                    return prev_le
                return prev_le + (le - prev_le) * ((rank - prev_n) / max(n - prev_n, 1e-12))
            prev_le, prev_n = le, n
        return prev_le

    return {
        "count": int(count),
        "p50_s": quantile(0.5),
        "p99_s": quantile(0.99),
        "mean_s": total / count if count else None,
    }


@dataclass
class ProcessSampler:
    """Samples one process' RSS and CPU time every ``period`` s in a thread, per named phase."""

    pid: int
    period: float = 0.5
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    _phase: str = "policy"
    _stop: threading.Event = field(default_factory=threading.Event)

    def _read(self) -> tuple[float, float]:
        rss_kib = 0.0
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kib = float(line.split()[1])
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return rss_kib / 1024, (int(fields[11]) + int(fields[12])) / ticks

    def phase(self, name: str) -> None:
        """Start phase ``name`` (the previous one ends now)."""
        self._sample()
        self._phase = name
        self._sample(begin=True)

    def _sample(self, begin: bool = False) -> None:
        try:
            rss, cpu = self._read()
        except (OSError, ValueError, IndexError):
            return
        now = time.monotonic()
        p = self.phases.setdefault(
            self._phase,
            {"rss_start_mib": rss, "rss_peak_mib": rss, "cpu_start_s": cpu, "t_start": now},
        )
        if begin:
            return
        p["rss_peak_mib"] = max(p["rss_peak_mib"], rss)
        p["rss_end_mib"] = rss
        p["cpu_s"] = cpu - p["cpu_start_s"]
        p["wall_s"] = now - p["t_start"]
        p["cpu_percent"] = 100 * p["cpu_s"] / p["wall_s"] if p["wall_s"] > 0 else 0.0

    def run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> ProcessSampler:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def rss_summary(self) -> dict[str, float | None]:
        """RSS (MiB) before the workload (the start of phase ``pods``), the peak of every phase
        so far, and now."""
        self._sample()
        try:
            now, _ = self._read()
        except (OSError, ValueError, IndexError):
            now = float("nan")
        before = self.phases.get("pods", {}).get("rss_start_mib")
        return {
            "before_mib": None if before is None else round(before, 1),
            "peak_mib": round(max(p["rss_peak_mib"] for p in self.phases.values()), 1),
            "after_settle_mib": round(now, 1),
        }

    def summary(self) -> dict[str, dict[str, float]]:
        keep = ("rss_start_mib", "rss_peak_mib", "rss_end_mib", "cpu_s", "wall_s", "cpu_percent")
        return {
            name: {k: round(v, 2) for k, v in p.items() if k in keep}
            for name, p in self.phases.items()
        }


# --------------------------------------------------------------------------- cluster objects


def wait_until(what: str, predicate: Any, timeout: float, period: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(period)


def create_nodes(cluster: LocalCluster, count: int) -> float:
    """Create ``count`` kwok nodes (8 at a time) and wait until all are Ready; returns seconds."""
    begin = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: cluster.create_fake_node(f"kwok-node-{i}", wait_ready=False), range(count)
            )
        )

    def ready() -> bool:
        nodes = cluster.request("/api/v1/nodes")["items"]
        return (
            sum(
                any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in n["status"].get("conditions") or []
                )
                for n in nodes
            )
            >= count
        )

    wait_until(f"{count} Ready nodes", ready, timeout=900, period=2)
    return time.monotonic() - begin


def _pod_template() -> dict[str, Any]:
    return {
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "trainer", "image": "trainer:scale"}],
        }
    }


def indexed_job(pods: int) -> dict[str, Any]:
    """One Indexed Job of ``pods`` pods (all in parallel), annotated for the policy."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": JOBSET, "annotations": {POLICY_LABEL: POLICY}},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "backoffLimit": 0,
            "completionMode": "Indexed",
            "template": _pod_template(),
        },
    }


def jobset(jobs: int, pods_per_job: int) -> dict[str, Any]:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JOBSET, "annotations": {POLICY_LABEL: POLICY}},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "w",
                    "replicas": jobs,
                    "template": {
                        "spec": {
                            "parallelism": pods_per_job,
                            "completions": pods_per_job,
                            "backoffLimit": 0,
                            "completionMode": "Indexed",
                            "template": _pod_template(),
                        }
                    },
                }
            ]
        },
    }


def workload_selector(workload: str) -> str:
    """The label selector of the workload's pods (and of a JobSet's child Jobs)."""
    if workload == "indexed-job":
        return f"batch.kubernetes.io/job-name={JOBSET}"
    return f"jobset.sigs.k8s.io/jobset-name={JOBSET}"


def list_pods(api: client.ApiClient, workload: str, keep_spec: bool) -> list[dict[str, Any]]:
    """The workload's pods, 500 per request; without ``keep_spec`` only their metadata and
    status (a 4,096-pod peers job is GiBs of pod specs)."""
    core = client.CoreV1Api(api)
    out: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": 500}
        if token:
            kwargs["_continue"] = token
        resp = core.list_namespaced_pod(
            NAMESPACE,
            label_selector=workload_selector(workload),
            _preload_content=False,
            **kwargs,
        )
        page = json.loads(resp.data)
        for pod in page["items"]:
            if not keep_spec:
                pod = {"metadata": pod["metadata"], "status": pod.get("status") or {}}
            out.append(pod)
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return out


def job_status(api: client.ApiClient, job_id: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "strata.dev", "v1alpha1", NAMESPACE, "checkpointpolicies", POLICY
    )
    for job in (obj.get("status") or {}).get("jobs") or []:
        if job.get("jobId") == job_id:
            return dict(job)
    return {}


# --------------------------------------------------------------------------- simulated sidecars


@dataclass(frozen=True)
class Sidecar:
    pod: str
    uid: str
    job_id: str
    token: str


def sidecars_for(api: client.ApiClient, pods: list[dict[str, Any]]) -> list[Sidecar]:
    """One identity per pod: a TokenRequest bound to the pod for the audience the webhook put in
    the pod's token volume (what the kubelet would write into the projected file)."""
    core = client.CoreV1Api(api)

    def one(pod: dict[str, Any]) -> Sidecar:
        meta, spec = pod["metadata"], pod["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == TOKEN_VOLUME)
        audience = next(
            s["serviceAccountToken"]["audience"]
            for s in volume["projected"]["sources"]
            if "serviceAccountToken" in s
        )
        env = {e["name"]: e.get("value") for e in spec["containers"][0].get("env") or []}
        job_id = json.loads(env["STRATA_CONFIG"])["job_id"]
        token = core.create_namespaced_service_account_token(
            spec.get("serviceAccountName") or "default",
            NAMESPACE,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [audience],
                    "expirationSeconds": 3600,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "uid": meta["uid"],
                    },
                },
            },
        ).status.token
        return Sidecar(meta["name"], meta["uid"], job_id, token)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, pods))


# The sidecar reporter's behaviour (strata.agent.reporter / ReportConfig defaults): a timeout per
# attempt, up to max_attempts on connection errors, timeouts, 408, 429 and 5xx, with a backoff
# of 0.5 s doubling (times 0.5-1.5 jitter); other answers end the report.
REPORT_TIMEOUT_S = float(ReportConfig.model_fields["timeout_seconds"].default)
REPORT_ATTEMPTS = int(ReportConfig.model_fields["max_attempts"].default)
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})


async def report_rounds(
    url: str, ca_file: Path, sidecars: list[Sidecar], rounds: int, interval: float
) -> list[dict[str, Any]]:
    """Every sidecar POSTs one report per round at its staggered offset, retrying like the
    reporter; returns one record per report: round, step, sent and done (monotonic s), latency_s
    (first attempt to final answer), attempt_latencies_s, attempts, status (final HTTP code or
    error name)."""
    ssl_ctx = ssl.create_default_context(cafile=str(ca_file))
    # A new connection per attempt, like the sidecar's urllib reporter.
    connector = aiohttp.TCPConnector(ssl=ssl_ctx, force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=REPORT_TIMEOUT_S)
    records: list[dict[str, Any]] = []
    start = time.monotonic() + 1.0
    rng = random.Random(0)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as http:

        async def post(body: bytes, headers: dict[str, str]) -> int | str:
            try:
                async with http.post(url + REPORT_PATH, data=body, headers=headers) as resp:
                    await resp.read()
                    return resp.status
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                return type(exc).__name__

        async def send(r: int, i: int, sc: Sidecar) -> None:
            await asyncio.sleep(
                max(0.0, start + r * interval + i * interval / len(sidecars) - time.monotonic())
            )
            step = (r + 1) * 100
            report = SidecarReport(
                policy=POLICY,
                namespace=NAMESPACE,
                pod_name=sc.pod,
                pod_uid=sc.uid,
                job_id=sc.job_id,
                tiers={
                    "ram": TierState(
                        newest_complete_step=step, newest_committed_step=step, complete_steps=2
                    )
                },
            )
            body = report.model_dump_json().encode()
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {sc.token}"}
            sent = time.monotonic()
            attempt_latencies: list[float] = []
            delay = 0.5
            while True:
                t0 = time.monotonic()
                status = await post(body, headers)
                attempt_latencies.append(time.monotonic() - t0)
                retry = not isinstance(status, int) or status in RETRYABLE
                if not retry or len(attempt_latencies) >= REPORT_ATTEMPTS:
                    break
                await asyncio.sleep(delay * (0.5 + rng.random()))
                delay = min(delay * 2, 30.0)
            done = time.monotonic()
            records.append(
                {
                    "round": r,
                    "step": step,
                    "sent": sent,
                    "done": done,
                    "latency_s": done - sent,
                    "attempt_latencies_s": attempt_latencies,
                    "attempts": len(attempt_latencies),
                    "status": status,
                }
            )

        await asyncio.gather(
            *(send(r, i, sc) for r in range(rounds) for i, sc in enumerate(sidecars))
        )
    return records


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "parameters": {k: v for k, v in vars(args).items() if k not in ("dir", "out")},
    }
    # The controller-manager's and scheduler's default client rate (20 and 50 requests/s) would
    # make pod creation, not Strata, the slow part of the run.
    # kwok logs every lease renewal at INFO: 100 lines/s with 1,000 nodes.
    qps = ["--kube-api-qps=200", "--kube-api-burst=400"]
    cluster = LocalCluster(
        args.dir,
        extra_args={"kube-controller-manager": qps, "kube-scheduler": qps, "kwok": ["--v=WARN"]},
    )
    print(f"[scale] starting the control plane in {args.dir}", flush=True)
    result["control_plane_start_s"] = round(cluster.start(), 1)
    try:
        result["nodes_ready_s"] = round(create_nodes(cluster, args.nodes), 1)
        print(f"[scale] {args.nodes} kwok nodes Ready in {result['nodes_ready_s']} s", flush=True)
        apply_crds(cluster)
        ensure_namespace(cluster, OPERATOR_NAMESPACE)
        ensure_namespace(cluster, NAMESPACE)
        wait_until(
            "the default ServiceAccount",
            lambda: _exists(cluster, f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"),
            timeout=60,
            period=0.2,
        )
        op = OperatorProcess(cluster, args.dir / "operator")
        op.start()
        js_ctl = JobSetController(cluster, locate_jobset(cluster.bin_dir), args.dir / "jobset")
        js_ctl.start()
        api = cluster.api_client()
        assert op.proc is not None
        try:
            with ProcessSampler(op.proc.pid) as sampler:
                _measure(args, cluster, api, op, sampler, result)
            result["operator_process"] = sampler.summary()
        finally:
            api.close()
            js_ctl.stop()
            op.stop()
    finally:
        cluster.stop()
    result["machine"]["loadavg_end"] = os.getloadavg()
    return result


def _exists(cluster: LocalCluster, path: str) -> bool:
    try:
        cluster.request(path)
    except OSError:
        return False
    return True


def _measure(
    args: argparse.Namespace,
    cluster: LocalCluster,
    api: client.ApiClient,
    op: OperatorProcess,
    sampler: ProcessSampler,
    result: dict[str, Any],
) -> None:
    custom = client.CustomObjectsApi(api)
    policy_spec: dict[str, Any] = {
        "tiers": {"ram": {"medium": "Memory", "sizeLimit": "64Mi", "keep": 2}}
    }
    if args.peers:
        policy_spec["peers"] = {"mode": "replicate", "copies": 1}
    custom.create_namespaced_custom_object(
        "strata.dev",
        "v1alpha1",
        NAMESPACE,
        "checkpointpolicies",
        {
            "apiVersion": "strata.dev/v1alpha1",
            "kind": "CheckpointPolicy",
            "metadata": {"name": POLICY, "namespace": NAMESPACE},
            "spec": policy_spec,
        },
    )
    sampler.phase("pods")
    per_job = args.pods // args.jobs
    begin = time.monotonic()
    if args.workload == "indexed-job":
        total = args.pods
        client.BatchV1Api(api).create_namespaced_job(NAMESPACE, indexed_job(total))
    else:
        total = per_job * args.jobs
        custom.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", jobset(args.jobs, per_job)
        )
    selector = workload_selector(args.workload).replace("=", "%3D")
    jobs_path = (
        f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs?fieldSelector=metadata.name%3D{JOBSET}"
        if args.workload == "indexed-job"
        else f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs?labelSelector={selector}"
    )

    def all_running() -> list[dict[str, Any]] | None:
        # The Jobs' counters are cheap; the injected pods are listed only once they all exist.
        # Running (phase), not Ready: when kwok, starved of CPU, renews node leases late, the
        # node lifecycle controller marks pods NotReady and kwok never sets them back.
        jobs = cluster.request(jobs_path)["items"]
        active = sum(j.get("status", {}).get("active", 0) for j in jobs)
        print(f"[scale] pods: {active} active ({len(jobs)} Jobs)", flush=True)
        if active < total:
            return None
        pods = list_pods(api, args.workload, keep_spec=args.rounds > 0)
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
        print(f"[scale] pods: {len(running)} Running", flush=True)
        return running if len(running) >= total else None

    pods = wait_until(f"{total} Running pods", all_running, timeout=3600, period=3)
    result["pods"] = {
        "workload": args.workload,
        "peers": args.peers,
        "count": total,
        "jobset_to_all_running_s": round(time.monotonic() - begin, 1),
    }
    injected = sum("strata.dev/injected" in (p["metadata"].get("annotations") or {}) for p in pods)
    result["pods"]["injected"] = injected
    result["pods"]["ready_condition_false"] = sum(
        any(
            c["type"] == "Ready" and c["status"] != "True"
            for c in p["status"].get("conditions", [])
        )
        for p in pods
    )
    op_metrics = _text(f"http://127.0.0.1:{op.metrics_port}/metrics")
    api_metrics = cluster.request("/metrics")
    reviews = sum(
        v
        for (name, labels), v in op.metrics().items()
        if name == "strata_admission_requests_total" and dict(labels).get("kind") == "Pod"
    )
    outcomes = {
        dict(labels)["outcome"]: int(v)
        for (name, labels), v in op.metrics().items()
        if name == "strata_admission_requests_total" and dict(labels).get("kind") == "Pod"
    }
    result["webhook"] = {
        "pod_admission_reviews": int(reviews),
        "outcomes": outcomes,
        "reviews_per_pod": round(reviews / total, 2),
        "handler": histogram(op_metrics, "strata_admission_duration_seconds", kind="Pod"),
        "apiserver_round_trip": histogram(
            api_metrics,
            "apiserver_admission_webhook_admission_duration_seconds",
            name="inject-pods",
        ),
    }

    if args.rounds > 0:
        sampler.phase("tokens")
        sidecars = sidecars_for(api, pods)
        sampler.phase("reports")
        print(
            f"[scale] {len(sidecars)} sidecars report every {args.interval} s, {args.rounds} rounds",
            flush=True,
        )
        records = asyncio.run(
            report_rounds(op.report_url, op.ca_file, sidecars, args.rounds, args.interval)
        )
        last_round = args.rounds - 1
        final_step = (last_round + 1) * 100
        job_id = sidecars[0].job_id
        last = [r for r in records if r["round"] == last_round]
        round_start = min(r["sent"] for r in last)
        last_answer = max(r["done"] for r in last)
        shown: dict[str, Any] = {}

        def status_at_final_step() -> float | None:
            shown.update(job_status(api, job_id).get("newestCompleteStep") or {})
            return time.monotonic() if shown.get("ram") == final_step else None

        try:
            status_seen: float | None = wait_until(
                f"status of {job_id} at step {final_step}",
                status_at_final_step,
                timeout=120,
                period=0.2,
            )
        except TimeoutError:
            status_seen = None
        sampler.phase("after")
        time.sleep(2)
        ok = [r["latency_s"] for r in records if _accepted(r)]
        first_attempts = [r["attempt_latencies_s"][0] for r in records]
        statuses: dict[str, int] = {}
        for r in records:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        receiver_hist = histogram(
            _text(f"http://127.0.0.1:{op.metrics_port}/metrics"), "strata_report_duration_seconds"
        )
        result["receiver"] = {
            "reports": len(records),
            "offered_rate_per_s": round(len(sidecars) / args.interval, 1),
            "statuses": statuses,
            "client": {
                "timeout_per_attempt_s": REPORT_TIMEOUT_S,
                "max_attempts": REPORT_ATTEMPTS,
                "attempts": sum(r["attempts"] for r in records),
                "accepted_reports": len(ok),
                "first_attempt_p50_s": _r(percentile(first_attempts, 50)),
                "first_attempt_p99_s": _r(percentile(first_attempts, 99)),
            },
            "client_latency_p50_s": _r(percentile(ok, 50)),
            "client_latency_p99_s": _r(percentile(ok, 99)),
            "client_latency_max_s": _r(max(ok) if ok else None),
            "handler": receiver_hist,
            "per_round": [_round_stats(records, r, args) for r in range(args.rounds)],
            # What the operator itself folded/refused (a report whose client timed out may still be
            # folded later).
            "server_folded": int(op.metric("strata_reports_received_total")),
            "server_rejected": {
                dict(labels)["reason"]: int(v)
                for (name, labels), v in op.metrics().items()
                if name == "strata_reports_rejected_total"
            },
        }
        result["status_convergence"] = {
            "final_step": final_step,
            "converged_within_120s_after_reports": status_seen is not None,
            "status_shows": shown,
            "from_last_round_start_s": None
            if status_seen is None
            else _r(status_seen - round_start),
            "last_answer_after_round_start_s": _r(last_answer - round_start),
            "after_last_answer_s": None
            if status_seen is None
            else _r(max(0.0, status_seen - last_answer)),
        }

    else:
        sampler.phase("after")
    # What the operator keeps once the load is over (RSS is sampled on).
    time.sleep(args.settle)
    result["operator_rss"] = sampler.rss_summary()


def _accepted(record: dict[str, Any]) -> bool:
    return isinstance(record["status"], int) and 200 <= record["status"] < 300


def _round_stats(records: list[dict[str, Any]], r: int, args: argparse.Namespace) -> dict[str, Any]:
    """Latency of round ``r``'s accepted reports, and when its last answer came relative to the
    round's scheduled end (``interval`` s after its first report): > 0 means a backlog."""
    mine = [x for x in records if x["round"] == r]
    ok = [x["latency_s"] for x in mine if _accepted(x)]
    start = min(x["sent"] for x in mine)
    return {
        "round": r,
        "accepted": len(ok),
        "p50_s": _r(percentile(ok, 50)),
        "p99_s": _r(percentile(ok, 99)),
        "last_answer_after_round_start_s": _r(max(x["done"] for x in mine) - start),
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _text(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as resp:
        return str(resp.read().decode())


def summary(result: dict[str, Any]) -> str:
    w = result["webhook"]
    rcv, conv = result.get("receiver"), result.get("status_convergence")
    ms = lambda v: "n/a" if v is None else f"{1000 * v:.0f} ms"  # noqa: E731
    pods = result["pods"]
    what = f"{pods['count']} pods ({pods['workload']}{', peers' if pods['peers'] else ''})"
    lines = [
        f"machine: {result['machine']['cpus']} CPUs, load {result['machine']['loadavg_start']} -> "
        f"{result['machine'].get('loadavg_end')}",
        f"nodes Ready: {result['nodes_ready_s']} s; {what} Running "
        f"{pods['jobset_to_all_running_s']} s after the workload ({pods['injected']} injected, "
        f"{pods['ready_condition_false']} with Ready=False)",
        f"webhook handler p50 {ms(w['handler']['p50_s'])} p99 {ms(w['handler']['p99_s'])} "
        f"({w['pod_admission_reviews']} Pod reviews, {w['reviews_per_pod']} per pod); apiserver round "
        f"trip p50 {ms(w['apiserver_round_trip']['p50_s'])} p99 {ms(w['apiserver_round_trip']['p99_s'])}",
    ]
    if rcv is not None and conv is not None:
        lines += [
            f"receiver ({rcv['reports']} reports offered at {rcv['offered_rate_per_s']}/s, "
            f"{rcv['client']['attempts']} attempts): accepted {rcv['client']['accepted_reports']}, "
            f"final statuses {rcv['statuses']}; first attempt p50 "
            f"{ms(rcv['client']['first_attempt_p50_s'])} p99 {ms(rcv['client']['first_attempt_p99_s'])}; "
            f"accepted report end to end p50 {ms(rcv['client_latency_p50_s'])} p99 "
            f"{ms(rcv['client_latency_p99_s'])} max {ms(rcv['client_latency_max_s'])}; handler p50 "
            f"{ms(rcv['handler']['p50_s'])} p99 {ms(rcv['handler']['p99_s'])}",
            f"per round: {rcv['per_round']}",
            f"operator side: folded {rcv['server_folded']}, rejected {rcv['server_rejected']}; "
            f"webhook outcomes {w['outcomes']}",
            f"status convergence (step {conv['final_step']}): converged "
            f"{conv['converged_within_120s_after_reports']}, status shows {conv['status_shows']}; "
            f"{conv['from_last_round_start_s']} s from the last round's start, "
            f"{conv['after_last_answer_s']} s after its last answered report (last answer "
            f"{conv['last_answer_after_round_start_s']} s into the round)",
        ]
    else:
        lines.append(f"webhook outcomes {w['outcomes']} (no reports: --rounds 0)")
    for phase, p in result.get("operator_process", {}).items():
        lines.append(
            f"operator [{phase}]: RSS {p.get('rss_start_mib')} -> peak {p.get('rss_peak_mib')} -> "
            f"{p.get('rss_end_mib')} MiB, CPU {p.get('cpu_s')} s in {p.get('wall_s')} s "
            f"({p.get('cpu_percent')} % of a core)"
        )
    rss = result.get("operator_rss") or {}
    lines.append(
        f"operator RSS: before {rss.get('before_mib')} MiB, peak {rss.get('peak_mib')} MiB, "
        f"{rss.get('after_settle_mib')} MiB {result['parameters']['settle']:.0f} s after the load"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.scale", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=10, help="child Jobs of the JobSet")
    parser.add_argument("--rounds", type=int, default=3, help="report rounds per sidecar")
    parser.add_argument(
        "--interval", type=float, default=10.0, help="seconds between a sidecar's reports"
    )
    parser.add_argument(
        "--workload",
        choices=("jobset", "indexed-job"),
        default="jobset",
        help="a JobSet of --jobs child Jobs, or one Indexed Job of --pods pods",
    )
    parser.add_argument(
        "--peers", action="store_true", help="the policy has spec.peers (replicate, 1 copy)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="seconds the operator's RSS is watched after the load (default %(default)s)",
    )
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / ".strata-run" / "scale")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "e2e" / "results" / "scale-latest.json"
    )
    args = parser.parse_args(argv)
    if args.workload == "jobset" and args.pods % args.jobs:
        parser.error("--pods must be a multiple of --jobs")
    if args.rounds < 0 or args.settle < 0:
        parser.error("--rounds and --settle must be >= 0 (0 rounds: admission only)")
    args.dir = args.dir.resolve()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"[scale] results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
