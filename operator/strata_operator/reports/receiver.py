"""Report receiver: sidecar reports -> ``CheckpointPolicy.status.jobs[]``, Events and metrics.

An HTTPS endpoint (aiohttp, own port, started from a kopf startup handler and stopped at cleanup)
accepting ``POST /v1/reports`` with a :class:`strata.reports.SidecarReport` body and
``Authorization: Bearer <projected service-account token>``. Each report is checked in this
order, and a failure is answered with the status below and counted in
``strata_reports_rejected_total{reason}``:

1. a bearer token is present (401 ``missing-token``);
2. a TokenReview for the report audience says it is authenticated and bound to a pod
   (``authentication.kubernetes.io/pod-name`` in the user's extra) (401 ``bad-token``); the
   answer is reused for the same token for up to :data:`TOKEN_CACHE_SECONDS` (never past its
   ``exp``; step 5 still checks the live pod, so a deleted pod's token is refused);
3. the body parses as a ``SidecarReport`` (400 ``malformed``);
4. the token's service account is in the report's namespace (403 ``namespace-mismatch``) and its
   pod is the report's pod (403 ``pod-mismatch``);
5. the pod exists with the token's pod uid (403 ``pod-not-found``) and carries the label
   ``strata.dev/policy: <report.policy>`` (403 ``policy-mismatch``), as the operator's watch of
   labelled pods last saw it (a GET when the watch has not seen it);
6. the policy exists (404 ``policy-not-found``).

Reports are coalesced (:mod:`strata_operator.reports.coalescer`): the reports queued for one policy
are folded in memory into ONE status patch, at most one per ``--status-interval`` seconds (1 s), and
each request is answered when the patch holding its report is written (so status and Events are
visible when the sidecar gets its 202). 1,000 ranks reporting every 10 s cost about one status write
per second, and a report's latency does not grow with the number queued.

Accepted reports are folded (:func:`strata_operator.reports.fold.fold_report`, pure) into
``status.jobs[]``: one entry per job id, newest first, at most :data:`strata_operator.api.MAX_JOBS`;
each with the newest complete step per tier, the last restore (tier, step, seconds, outcome, time)
and the last error; and ``status.newestCompleteStep`` of the job reported last (printer columns).
The sidecars' termination flush estimates become ``status.jobs[].flush`` and the policy's
``FlushFitsGracePeriod`` condition (:func:`strata_operator.reports.fold.with_flush_condition`),
written in the same patch; ``FlushTooSlow``/``FlushMissedDeadline`` Warning Events go with it.
Reports from sidecars that send no ``flush`` (older versions) fold as before.
The status is written with a merge patch guarded by ``resourceVersion`` (a conflict re-reads and
re-folds the batch), then Events are posted on the policy: ``Restored`` (Normal),
``FreshStart``/``RestoreFailed``/``TierFailed`` (Warning), each only for restores and errors newer
than what the status already held, so a re-sent report does not repeat them.

Pods labelled for a policy but running without the sidecar (the webhook was skipped under
``failurePolicy: Ignore``, C-10) get a ``NotProtected`` Warning Event, on the pod and on the
policy, once per pod.

The role joins the operator as :class:`ReportReceiver` (an
:class:`strata_operator.extension.Extension`): it declares the ``--report-*``, ``--status-interval``
and ``--metrics-*`` flags, takes the TLS files from the :class:`~strata_operator.extension.Wiring`,
and registers its startup/cleanup handlers and the labelled-pod watch. The status and the Events
are written through :mod:`strata_operator.cluster`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import hashlib
import json
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from aiohttp import web
from pydantic import ValidationError

from strata.constants import REPORT_PATH
from strata.errors import StrataError
from strata.reports import SidecarReport
from strata_operator import certs, memory
from strata_operator import metrics as m
from strata_operator.cluster import EventRecorder, EventSpec, StatusWriter, get_policy
from strata_operator.constants import (
    ACTION_CHECK_POD,
    ACTION_FOLD_REPORT,
    EVENT_NOT_PROTECTED,
    INJECTED_ANNOTATION,
    POLICY_LABEL,
    SIDECAR_NAME,
)
from strata_operator.extension import Wiring
from strata_operator.reports.coalescer import Coalescer, QueueFull
from strata_operator.reports.fold import fold_report, with_flush_condition

log = logging.getLogger("strata.receiver")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"
MAX_BODY_BYTES = 256 * 1024
TOKEN_CACHE_SECONDS = 300.0
"""How long a TokenReview answer is reused for the same token, at most (never past the token's
own ``exp``). A pod-bound token is revoked by deleting its pod, and every report is checked
against the live pod (watch, or a GET), so the cache never admits a deleted pod's token."""
API_THREADS = 32
"""Worker threads for the receiver's blocking API calls (TokenReview, GETs, status patches)."""
MAX_PENDING_PER_POLICY = 20_000
"""Reports queued for one policy's next status patch; beyond it the oldest are answered 503."""


class Rejected(StrataError):
    """A report refused with an HTTP ``status`` and a metrics ``reason``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


# --- the server -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodFacts:
    """What the receiver needs to know about a labelled pod (from the pod watch or a GET)."""

    uid: str | None
    policy: str | None


@dataclass
class ReceiverState:
    """Run-time state of the receiver (:attr:`ReportReceiver.state`)."""

    host: str
    port: int
    audience: str
    tls: certs.TlsFiles
    auth_api: Any = None
    core_api: Any = None
    custom_api: Any = None
    events: EventRecorder | None = None
    """Events on policies and pods (None: none are posted)."""
    status_interval: float = 1.0
    """Seconds between two status patches of one policy (reports in between are folded)."""
    runner: web.AppRunner | None = None
    batches: Coalescer[tuple[str, str], SidecarReport, int] | None = None
    warned_pods: OrderedDict[str, None] = field(default_factory=OrderedDict)
    posted: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Keys of events already posted (a re-sent report must not repeat them); bounded."""
    tokens: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    """sha256(token) -> (monotonic expiry, identity) of tokens the apiserver authenticated."""
    pods: dict[tuple[str, str], PodFacts] = field(default_factory=dict)
    """Labelled pods as the pod watch last saw them (namespace, name)."""
    executor: ThreadPoolExecutor | None = None

    def writer(self) -> StatusWriter:
        """The writer of ``status.jobs`` (:class:`strata_operator.cluster.StatusWriter`)."""
        return StatusWriter(self.custom_api, timeout=10)

    def post_event(self, obj: dict[str, Any], event: EventSpec) -> None:
        """Post ``event`` about ``obj`` (blocking; a repeat joins the first one's series)."""
        if self.events is not None:
            self.events.post(obj, event)

    def first_time(self, key: str) -> bool:
        if not key:
            return True
        if key in self.posted:
            return False
        self.posted[key] = None
        while len(self.posted) > 10_000:
            self.posted.popitem(last=False)
        return True

    def cached_identity(self, token: str) -> dict[str, Any] | None:
        entry = self.tokens.get(hashlib.sha256(token.encode()).hexdigest())
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def remember_identity(self, token: str, identity: dict[str, Any]) -> None:
        now = time.monotonic()
        if len(self.tokens) > 50_000:
            self.tokens = {k: v for k, v in self.tokens.items() if v[0] >= now}
        ttl = min(TOKEN_CACHE_SECONDS, _seconds_left(token))
        if ttl > 0:
            digest = hashlib.sha256(token.encode()).hexdigest()
            self.tokens[digest] = (now + ttl, identity)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (a blocking API call) on the receiver's own threads, so that a burst of
        reports neither waits for nor starves the default executor."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(API_THREADS, thread_name_prefix="strata-receiver")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))


def _seconds_left(token: str) -> float:
    """Seconds until the JWT's ``exp`` (read only after the apiserver authenticated it); 0 when
    it has none or cannot be read."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return max(0.0, float(claims["exp"]) - time.time())
    except (IndexError, KeyError, TypeError, ValueError):
        return 0.0


def _review_token(auth_api: Any, token: str, audience: str) -> dict[str, Any]:
    from kubernetes import client

    review = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[audience]))
    resp = auth_api.create_token_review(review, _request_timeout=10)
    status = resp.status
    if status is None or not status.authenticated:
        raise Rejected(401, "bad-token", f"token not authenticated: {getattr(status, 'error', '')}")
    if audience not in (status.audiences or []):
        raise Rejected(401, "bad-token", f"token is not for audience {audience!r}")
    user = status.user
    extra = user.extra or {}
    pod_names = extra.get(POD_NAME_EXTRA) or []
    if not pod_names:
        raise Rejected(401, "bad-token", "token is not bound to a pod (use a projected token)")
    username = user.username or ""
    if not username.startswith(SA_PREFIX):
        raise Rejected(401, "bad-token", f"token of {username!r} is not a service account's")
    namespace = username[len(SA_PREFIX) :].split(":", 1)[0]
    pod_uids = extra.get(POD_UID_EXTRA) or []
    return {
        "namespace": namespace,
        "pod_name": pod_names[0],
        "pod_uid": pod_uids[0] if pod_uids else None,
    }


def _get_pod(core_api: Any, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        resp = core_api.read_namespaced_pod(
            name, namespace, _preload_content=False, _request_timeout=10
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    data: dict[str, Any] = json.loads(resp.data)
    return data


async def handle_report(state: ReceiverState, request: web.Request) -> web.Response:
    start = time.perf_counter()
    try:
        result = await _handle(state, request)
        m.REPORTS_RECEIVED.inc()
        return web.json_response(result, status=202)
    except Rejected as rej:
        m.REPORTS_REJECTED.labels(reason=rej.reason).inc()
        log.info("report rejected (%s): %s", rej.reason, rej.message)
        return web.json_response({"error": rej.reason, "message": rej.message}, status=rej.status)
    finally:
        m.REPORT_DURATION.observe(time.perf_counter() - start)
        memory.TRIMMER.closed()  # returns the heap freed by closed report connections


async def _handle(state: ReceiverState, request: web.Request) -> dict[str, Any]:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Rejected(401, "missing-token", "Authorization: Bearer <token> is required")
    identity = state.cached_identity(token)
    if identity is None:
        identity = await state.call(_review_token, state.auth_api, token, state.audience)
        state.remember_identity(token, identity)
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise Rejected(400, "malformed", f"body larger than {MAX_BODY_BYTES} bytes")
    raw = await request.read()
    if len(raw) > MAX_BODY_BYTES:
        raise Rejected(400, "malformed", f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        report = SidecarReport.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in exc.errors()
        )
        raise Rejected(400, "malformed", f"not a SidecarReport: {problems}"[:1024]) from None
    if identity["namespace"] != report.namespace:
        raise Rejected(
            403,
            "namespace-mismatch",
            f"token of namespace {identity['namespace']!r} cannot report for namespace "
            f"{report.namespace!r}",
        )
    if identity["pod_name"] != report.pod_name:
        raise Rejected(
            403,
            "pod-mismatch",
            f"token of pod {identity['pod_name']!r} cannot report for pod {report.pod_name!r}",
        )
    pod = await _pod_facts(state, report.namespace, report.pod_name, identity["pod_uid"])
    if pod is None:
        raise Rejected(403, "pod-not-found", f"pod {report.namespace}/{report.pod_name} not found")
    if pod.policy != report.policy:
        raise Rejected(
            403,
            "policy-mismatch",
            f"pod {report.namespace}/{report.pod_name} is not labelled "
            f"{POLICY_LABEL}={report.policy}",
        )
    assert state.batches is not None  # created by start_receiver
    try:
        events = await state.batches.submit((report.namespace, report.policy), report)
    except QueueFull:
        raise Rejected(503, "busy", "too many reports queued for this policy; retry") from None
    return {"accepted": True, "jobId": report.job_id, "events": events}


async def _pod_facts(
    state: ReceiverState, namespace: str, name: str, token_uid: str | None
) -> PodFacts | None:
    """The pod of a token: from the pod watch, else (not seen yet, or another uid) a GET."""
    known = state.pods.get((namespace, name))
    if known is not None and (not token_uid or known.uid == token_uid):
        return known
    pod = await state.call(_get_pod, state.core_api, namespace, name)
    meta = (pod or {}).get("metadata") or {}
    if pod is None or (token_uid and token_uid != meta.get("uid")):
        return None
    return PodFacts(uid=meta.get("uid"), policy=(meta.get("labels") or {}).get(POLICY_LABEL))


async def fold_batch(
    state: ReceiverState, key: tuple[str, str], reports: Sequence[SidecarReport]
) -> list[int]:
    """Fold every queued report of one policy into ONE status patch, then post their Events.

    Returns the number of events of each report. Raises :class:`Rejected` for all of them when
    the policy is gone or its status keeps conflicting.
    """
    namespace, name = key
    for _ in range(8):
        policy = await state.call(get_policy, state.custom_api, namespace, name, timeout=10)
        if policy is None:
            raise Rejected(
                404, "policy-not-found", f"CheckpointPolicy {namespace}/{name} not found"
            )
        jobs = (policy.get("status") or {}).get("jobs") or []
        now = datetime.now(UTC)
        per_report: list[list[EventSpec]] = []
        for report in reports:
            jobs, events = fold_report(jobs, report, now=now)
            per_report.append(events)
        patch: dict[str, Any] = {"jobs": jobs}
        if jobs and jobs[0].get("newestCompleteStep"):
            patch["newestCompleteStep"] = jobs[0]["newestCompleteStep"]
        conditions = with_flush_condition((policy.get("status") or {}).get("conditions"), jobs)
        if conditions is not None:
            patch["conditions"] = conditions
        rv = policy["metadata"]["resourceVersion"]
        if await state.call(state.writer().write_jobs, namespace, name, rv, patch):
            break
    else:
        raise Rejected(409, "status-conflict", "the policy status kept changing; retry")
    m.STATUS_PATCHES.inc()
    m.REPORTS_PER_PATCH.observe(len(reports))
    for events in per_report:
        for event in events:
            if state.first_time(event.key):
                await state.call(state.post_event, policy, event)
    return [len(events) for events in per_report]


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def _ssl_context(tls: certs.TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(tls.certfile), str(tls.keyfile))
    return context


class ReportReceiver:
    """The reports role (an :class:`strata_operator.extension.Extension`): the HTTPS report
    endpoint, the labelled-pod watch that feeds it, and the metrics endpoint. Its run-time state
    is :attr:`state` (set by :meth:`configure`)."""

    name = "reports"
    leader_only = True
    """Runs only on the replica holding the Lease (``--leader-elect``): it writes policies."""

    def __init__(self, state: ReceiverState | None = None) -> None:
        self.state = state

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("report receiver and metrics")
        g.add_argument(
            "--report-port", type=int, default=8444, help="HTTPS report port (0: off; default 8444)"
        )
        g.add_argument("--report-listen", default="0.0.0.0", help="bind address (default 0.0.0.0)")
        g.add_argument(
            "--report-url",
            help="base URL sidecars use, e.g. https://strata.strata-system.svc:8444 (default: "
            "https://<--webhook-host>:<--report-port>)",
        )
        g.add_argument(
            "--report-audience",
            default="strata.dev",
            help="audience of the projected tokens (default %(default)s)",
        )
        g.add_argument(
            "--status-interval",
            type=float,
            default=1.0,
            metavar="SECONDS",
            help="seconds between two status patches of one policy; reports in between are folded "
            "into the next one (default %(default)s)",
        )
        g.add_argument(
            "--metrics-port", type=int, default=8095, help="plain-HTTP /metrics port (0: off)"
        )
        g.add_argument("--metrics-listen", default="0.0.0.0")

    def configure(self, args: argparse.Namespace, wiring: Wiring) -> None:
        """Set up the receiver's state with its own API connection pool, and serve metrics."""
        from kubernetes import client

        # The receiver gets its own connection pool, as large as its thread pool, so that a
        # burst of reports does not queue on connections.
        configuration = client.Configuration.get_default_copy()
        configuration.connection_pool_maxsize = API_THREADS
        api_client = client.ApiClient(configuration)
        self.state = ReceiverState(
            host=args.report_listen,
            port=args.report_port,
            audience=args.report_audience,
            tls=wiring.tls,
            auth_api=client.AuthenticationV1Api(api_client),
            core_api=client.CoreV1Api(api_client),
            custom_api=client.CustomObjectsApi(api_client),
            events=EventRecorder(api_client, action=ACTION_FOLD_REPORT),
            status_interval=args.status_interval,
        )
        if args.metrics_port:
            m.serve(args.metrics_port, args.metrics_listen)

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Start/stop of the endpoint and the watch of labelled pods."""
        kopf.on.startup(id="start_receiver", registry=registry)(self.start)
        kopf.on.cleanup(id="stop_receiver", registry=registry)(self.stop)
        kopf.on.event(
            "",
            "v1",
            "pods",
            labels={POLICY_LABEL: kopf.PRESENT},
            id="labelled_pod",
            registry=registry,
        )(self.labelled_pod)

    async def start(self, **_: Any) -> None:
        """Start the HTTPS report endpoint in kopf's event loop (stopped by :meth:`stop`)."""
        state = self.state
        if state is None or state.port == 0:
            return
        app = web.Application(client_max_size=MAX_BODY_BYTES)

        async def _report(request: web.Request) -> web.Response:
            return await handle_report(state, request)

        app.add_routes([web.post(REPORT_PATH, _report), web.get("/healthz", healthz)])
        state.batches = Coalescer(
            functools.partial(fold_batch, state),
            interval=state.status_interval,
            max_pending=MAX_PENDING_PER_POLICY,
        )
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, state.host, state.port, ssl_context=_ssl_context(state.tls))
        await site.start()
        state.runner = runner
        log.info(
            "report receiver listening on https://%s:%d%s", state.host, state.port, REPORT_PATH
        )

    async def stop(self, **_: Any) -> None:
        """Stop the endpoint, answer what is queued, and release the API threads."""
        state = self.state
        if state is not None and state.runner is not None:
            await state.runner.cleanup()
            state.runner = None
        if state is not None and state.batches is not None:
            await state.batches.close()
        if state is not None and state.executor is not None:
            state.executor.shutdown(wait=False, cancel_futures=True)
            # A replica that leads again later starts the receiver again with new threads.
            state.executor = None

    async def labelled_pod(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        """Keep the receiver's view of labelled pods (no GET per report), and report a labelled pod
        running without the sidecar (C-10, failurePolicy Ignore).

        The pod watch has a server-side label selector (``strata_operator.main.tune_kopf``): the
        operator never receives the cluster's other pods.
        """
        state = self.state
        meta = body.get("metadata") or {}
        if state is None:
            return
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if type == "DELETED":
            state.pods.pop(key, None)
            return
        state.pods[key] = PodFacts(
            uid=meta.get("uid"), policy=(meta.get("labels") or {}).get(POLICY_LABEL)
        )
        uid = meta.get("uid")
        annotations = meta.get("annotations") or {}
        if INJECTED_ANNOTATION in annotations:
            return
        if not uid or uid in state.warned_pods or meta.get("deletionTimestamp"):
            return
        spec = body.get("spec") or {}
        if any(c.get("name") == SIDECAR_NAME for c in spec.get("initContainers") or []):
            return
        state.warned_pods[uid] = None
        while len(state.warned_pods) > 10_000:
            state.warned_pods.popitem(last=False)
        m.PODS_UNINJECTED.inc()
        ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        policy_name = str((meta.get("labels") or {}).get(POLICY_LABEL) or "")
        event = EventSpec(
            "Warning",
            EVENT_NOT_PROTECTED,
            f"pod {ns}/{name} is labelled {POLICY_LABEL}={policy_name} but runs without the Strata "
            "sidecar: it was created while the webhook was unreachable (failurePolicy Ignore) or in "
            "an excluded namespace; its checkpoints are not protected. Recreate the pod.",
            action=ACTION_CHECK_POD,
        )
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(meta)}
        await asyncio.to_thread(state.post_event, pod, event)
        policy = await asyncio.to_thread(get_policy, state.custom_api, ns, policy_name, timeout=10)
        if policy is not None:
            await asyncio.to_thread(state.post_event, policy, event)
