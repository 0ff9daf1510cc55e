"""``kubectl strata status`` and ``kubectl strata describe job``: what the CheckpointPolicy
status holds (the operator folds the sidecars' reports into it), plus the pods it concerns.

Everything shown comes from the apiserver: ``status.conditions``, ``status.jobs[]``
(``newestCompleteStep`` per tier, ``lastRestore``, ``lastError``), and the pods. A pod is
*unprotected* when it names a policy (label ``strata.dev/policy``) but was not injected
(no ``strata.dev/injected`` annotation: created while the webhook was down, or before the
policy existed) and has not finished.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

from strata.cli import output
from strata_operator.admission.mutation import job_id_for
from strata_operator.constants import INJECTED_ANNOTATION, POLICY_LABEL
from strata_operator.kubectl import EXIT_NOT_FOUND, EXIT_OK, PluginError, print_doc
from strata_operator.kubectl.cluster import Cluster

TIERS = ("ram", "pvc", "gcs")


def _age(ts: str | None) -> str:
    if not ts:
        return "-"
    try:
        t = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return ts
    return output.human_age((datetime.now(UTC) - t).total_seconds()) + " ago"


def _ready(policy: dict[str, Any]) -> dict[str, Any] | None:
    for c in (policy.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return {
                "status": c.get("status"),
                "reason": c.get("reason"),
                "message": c.get("message"),
            }
    return None


def _where(spec: dict[str, Any]) -> dict[str, Any]:
    tiers = spec.get("tiers") or {}
    out: dict[str, Any] = {"ram": {"medium": (tiers.get("ram") or {}).get("medium", "Memory")}}
    if tiers.get("pvc"):
        out["pvc"] = {
            "claimName": tiers["pvc"]["claimName"],
            "subPath": tiers["pvc"].get("subPath"),
        }
    if tiers.get("gcs"):
        g = tiers["gcs"]
        out["gcs"] = {"url": f"gs://{g['bucket']}/{g.get('prefix', '')}".rstrip("/")}
    return out


def _unprotected(policy: dict[str, Any], pods: list[dict[str, Any]]) -> list[str]:
    ns, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("namespace") != ns or (meta.get("labels") or {}).get(POLICY_LABEL) != name:
            continue
        if INJECTED_ANNOTATION in (meta.get("annotations") or {}):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        out.append(meta["name"])
    return sorted(out)


def policy_doc(policy: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    status = policy.get("status") or {}
    return {
        "namespace": policy["metadata"]["namespace"],
        "policy": policy["metadata"]["name"],
        "ready": _ready(policy),
        "tiers": _where(policy.get("spec") or {}),
        "jobs": [
            {
                "jobId": j.get("jobId"),
                "newestCompleteStep": {
                    t: (j.get("newestCompleteStep") or {}).get(t) for t in TIERS
                },
                "lastRestore": j.get("lastRestore"),
                "lastError": j.get("lastError"),
                "updateTime": j.get("updateTime"),
            }
            for j in status.get("jobs") or []
        ],
        "unprotectedPods": _unprotected(policy, pods),
    }


def _restore_text(r: dict[str, Any] | None) -> str:
    if not r:
        return "-"
    outcome = r.get("outcome", "restored")
    if outcome == "restored":
        text = f"step {r.get('step')} from {r.get('tier')}"
        if r.get("seconds") is not None:
            text += f" in {float(r['seconds']):.2f} s"
    else:
        text = outcome
    return f"{text}, {_age(r.get('time'))}"


def status(cluster: Cluster, args: argparse.Namespace) -> int:
    namespace = None if args.all_namespaces else (args.namespace or cluster.default_namespace)
    policies = cluster.policies(namespace)
    if args.policy:
        policies = [p for p in policies if p["metadata"]["name"] == args.policy]
        if not policies:
            where = "any namespace" if namespace is None else f"namespace {namespace}"
            raise PluginError(f"no CheckpointPolicy {args.policy!r} in {where}", EXIT_NOT_FOUND)
    # Only pods that name a policy can be unprotected.
    pods = cluster.pods(namespace, label_selector=POLICY_LABEL) if policies else []
    docs = [policy_doc(p, pods) for p in policies]
    if args.output != "table":
        print_doc(docs, args.output)
        return EXIT_OK
    con = output.stdout()
    if not docs:
        where = "any namespace" if namespace is None else f"namespace {namespace}"
        con.print(f"no CheckpointPolicy in {where}", markup=False)
        return EXIT_OK
    for d in docs:
        ready = d["ready"] or {}
        where = ", ".join(
            [f"ram ({d['tiers']['ram']['medium']})"]
            + ([f"pvc {d['tiers']['pvc']['claimName']}"] if "pvc" in d["tiers"] else [])
            + ([d["tiers"]["gcs"]["url"]] if "gcs" in d["tiers"] else [])
        )
        con.print(
            f"[bold]{d['namespace']}/{d['policy']}[/]  Ready={ready.get('status', '?')} "
            f"({ready.get('reason', 'no condition yet')})  tiers: {where}"
        )
        if d["jobs"]:
            output.table(
                None,
                ("job", "ram", "pvc", "gcs", "last restore", "last error"),
                [
                    (
                        j["jobId"],
                        *(j["newestCompleteStep"][t] for t in TIERS),
                        _restore_text(j["lastRestore"]),
                        (j["lastError"] or {}).get("message", "-"),
                    )
                    for j in d["jobs"]
                ],
                con,
            )
        else:
            con.print("  no job has reported yet", markup=False)
        if d["unprotectedPods"]:
            con.print(
                f"  [bold red]unprotected pods[/] (label {POLICY_LABEL}={d['policy']} but not "
                f"injected; recreate them): {', '.join(d['unprotectedPods'])}"
            )
    return EXIT_OK


def find_job(
    cluster: Cluster, job: str, namespace: str | None, all_namespaces: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(policy, its status.jobs[] entry) reporting ``job``; PluginError(3) when none does.

    Searched: every namespace with ``-A``; else ``namespace`` (or the context's), then the
    namespace the job id names (``<namespace>.<workload>``)."""
    if all_namespaces:
        candidates: list[str | None] = [None]
    else:
        candidates = [namespace or cluster.default_namespace]
        if namespace is None and "." in job and job.split(".", 1)[0] not in candidates:
            candidates.append(job.split(".", 1)[0])
    for ns in candidates:
        for p in cluster.policies(ns):
            for j in (p.get("status") or {}).get("jobs") or []:
                if j.get("jobId") == job:
                    return p, j
    where = "any namespace" if all_namespaces else f"namespace(s) {', '.join(map(str, candidates))}"
    raise PluginError(
        f"no CheckpointPolicy in {where} reports job {job!r}; `kubectl strata status -A` lists "
        "the jobs (a job appears once its sidecar has reported)",
        EXIT_NOT_FOUND,
    )


def describe(cluster: Cluster, args: argparse.Namespace) -> int:
    policy, entry = find_job(cluster, args.job, args.namespace, args.all_namespaces)
    ns = policy["metadata"]["namespace"]
    pods = []
    for pod in cluster.pods(ns):
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if INJECTED_ANNOTATION not in ann and POLICY_LABEL not in (meta.get("labels") or {}):
            continue
        try:
            if job_id_for(pod, ns) != args.job:
                continue
        except ValueError:
            continue
        st = pod.get("status") or {}
        pods.append(
            {
                "name": meta["name"],
                "phase": st.get("phase"),
                "node": (pod.get("spec") or {}).get("nodeName"),
                "injected": INJECTED_ANNOTATION in ann,
                "restarts": sum(
                    c.get("restartCount", 0) for c in st.get("containerStatuses") or []
                ),
            }
        )
    doc = {
        "job": args.job,
        "namespace": ns,
        "policy": policy["metadata"]["name"],
        "tiers": _where(policy.get("spec") or {}),
        "newestCompleteStep": {t: (entry.get("newestCompleteStep") or {}).get(t) for t in TIERS},
        "lastRestore": entry.get("lastRestore"),
        "lastError": entry.get("lastError"),
        "updateTime": entry.get("updateTime"),
        "pods": pods,
    }
    if args.output != "table":
        print_doc(doc, args.output)
        return EXIT_OK
    con = output.stdout()
    lines = [
        f"Job:            {doc['job']}",
        f"Namespace:      {ns}",
        f"Policy:         {doc['policy']}",
        f"RAM tier:       {doc['tiers']['ram']['medium']} on each pod's node",
    ]
    if "pvc" in doc["tiers"]:
        pvc = doc["tiers"]["pvc"]
        lines.append(
            f"PVC tier:       claim {pvc['claimName']}"
            + (f", subPath {pvc['subPath']}" if pvc["subPath"] else "")
        )
    if "gcs" in doc["tiers"]:
        lines.append(f"GCS tier:       {doc['tiers']['gcs']['url']}")
    steps = doc["newestCompleteStep"]
    lines.append(
        "Newest complete step: "
        + ", ".join(f"{t} {steps[t] if steps[t] is not None else '-'}" for t in TIERS)
    )
    lines.append(f"Last restore:   {_restore_text(doc['lastRestore'])}")
    err = doc["lastError"]
    lines.append(
        "Last error:     "
        + (
            f"{err.get('tier') or ''} {err.get('message')} ({_age(err.get('time'))})"
            if err
            else "-"
        )
    )
    lines.append(f"Last report:    {_age(doc['updateTime'])}")
    for line in lines:
        con.print(line, markup=False, highlight=False)
    if pods:
        output.table(
            "Pods",
            ("pod", "phase", "node", "injected", "restarts"),
            [
                (p["name"], p["phase"], p["node"], "yes" if p["injected"] else "NO", p["restarts"])
                for p in pods
            ],
            con,
        )
    else:
        con.print("Pods:           none running", markup=False)
    return EXIT_OK
