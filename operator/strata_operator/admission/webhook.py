"""Admission webhooks served by the operator (kopf ``on.mutate``): pod injection and workload labels.

Handlers (each its own webhook in the configuration, addressed by its kopf handler id):

* ``inject-pods``: Pods on CREATE whose label ``strata.dev/policy`` exists (objectSelector) get the
  patch of :func:`strata_operator.admission.mutation.build_pod_patch`;
* ``label-jobs``, ``label-jobsets``, ``label-pytorchjobs``: Jobs, JobSets and PyTorchJobs on
  CREATE carrying the annotation ``strata.dev/policy`` (a CEL ``matchCondition``, because an
  objectSelector sees labels only) get the label on every pod template
  (:func:`strata_operator.admission.workloads.build_workload_patch`).

A policy that does not exist in the object's namespace is a denial (HTTP 403) whose message names
the policy and the namespace; a pod or policy that cannot be injected is a denial (422) that says
why (:mod:`strata_operator.admission.pod_checks`). Every denial message starts with "Strata: ", and
no policy the API accepted can make the webhook answer 5xx: an unexpected error is a 422 denial that
says so (only an API failure reading the policy is a 503). A reinvocation (the apiserver calls again
after later plugins changed an injected pod) returns at once, without reading the policy. The
handlers read the policy from the operator's own watch
(:mod:`strata_operator.admission.policy_cache`; a GET when the watch has not delivered it yet, and
for every admission after a start until the watch has caught up with a LIST made before the first)
and call nothing else, except for a ``spec.peers`` policy the pod's workload and the job's peer
Secret (a dry run skips the Secret, ``sideEffects: NoneOnDryRun``), both asked once per burst of
a job (:mod:`strata_operator.admission.peer_admission`).

The ``MutatingWebhookConfiguration`` and the server that publishes it before it listens are
:mod:`strata_operator.admission.configuration`'s.

The role joins the operator as :class:`Webhook` (an :class:`strata_operator.extension.Extension`):
it declares the ``--webhook-*`` and ``--sidecar-*`` flags, takes the TLS files and the report
endpoint from the :class:`~strata_operator.extension.Wiring`, and registers its handlers into
the registry ``main`` gives it. Domain errors (``InjectionError``) become
``kopf.AdmissionError`` here and nowhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import kopf

from strata_operator import api, certs, memory
from strata_operator import constants as k
from strata_operator import metrics as m
from strata_operator.admission import peer_admission, pod_checks
from strata_operator.admission.configuration import (
    WORKLOAD_WEBHOOKS,
    ManagedWebhookServer,
    WebhookOptions,
    apply_webhook_configuration,
    build_webhook_configuration,
)
from strata_operator.admission.mutation import (
    InjectionError,
    InjectionSettings,
    build_pod_patch,
    job_id_for,
)
from strata_operator.admission.policy_cache import POLICY_READS, PolicyCache, PolicyWatch
from strata_operator.admission.workloads import build_workload_patch
from strata_operator.api import conditions
from strata_operator.cluster import get_policy
from strata_operator.constants import DENIAL_PREFIX, POD_WEBHOOK, POLICY_LABEL
from strata_operator.extension import Wiring

log = logging.getLogger("strata.webhook")

DENY_MISSING_POLICY = 403
DENY_INVALID = 422


@dataclass
class WebhookState:
    """What the handlers need at run time (:attr:`Webhook.state`)."""

    options: WebhookOptions
    injection: InjectionSettings
    tls: certs.TlsFiles
    custom_api: Any = None
    admission_api: Any = None
    core_api: Any = None
    batch_api: Any = None
    policies: PolicyCache = field(default_factory=PolicyCache)
    namespaces: tuple[str, ...] = ()
    """The operator's ``--namespace`` patterns (kopf's: globs, ``!`` excludes); empty: all."""
    watch: PolicyWatch | None = None
    """The webhook's own policy watch (started with the server); None: not started (tests)."""
    peers: peer_admission.PeerAdmission = field(default_factory=peer_admission.PeerAdmission)
    """Workload reads and peer Secret creation of ``spec.peers`` pods, with their caches."""

    async def get_policy(self, namespace: str, name: str) -> dict[str, Any]:
        """The CheckpointPolicy object (from the watch's cache, :mod:`strata_operator.admission.policy_cache`;
        a GET on a miss), or ``kopf.AdmissionError`` (403) naming it."""
        from kubernetes.client.exceptions import ApiException

        if not name:
            raise kopf.AdmissionError(
                f"the {POLICY_LABEL} label or annotation is empty; set it to the name of a "
                f"CheckpointPolicy in namespace {namespace!r}",
                code=DENY_INVALID,
            )
        if self.watch is not None and not self.watch.listed.is_set():
            # Just started: wait briefly for the first LIST; a GET answers meanwhile.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.watch.listed.wait(), max(1, self.options.timeout_seconds - 3)
                )
        # Until the watch has caught up with the LIST (after a restart), only a GET is as fresh
        # as the apiserver.
        synced, cached = self.policies.get_synced(namespace, name)
        if not synced:
            cached = None
        if cached is not None:
            POLICY_READS.labels(source="cache").inc()
            return cached
        POLICY_READS.labels(source="api").inc()
        try:
            obj = await asyncio.to_thread(
                get_policy,
                self.custom_api,
                namespace,
                name,
                timeout=max(1, self.options.timeout_seconds - 2),
            )
        except ApiException as exc:
            raise kopf.AdmissionError(
                f"cannot read CheckpointPolicy {namespace}/{name}: API error {exc.status} "
                f"{exc.reason}",
                code=503,
            ) from None
        if obj is None:
            raise kopf.AdmissionError(
                f"CheckpointPolicy {name!r} not found in namespace {namespace!r} (named by "
                f"{POLICY_LABEL}); create the policy first, or fix or remove the "
                f"{POLICY_LABEL} label/annotation",
                code=DENY_MISSING_POLICY,
            )
        return obj


def _not_ready_warning(policy: Mapping[str, Any]) -> str | None:
    cond = conditions.find((policy.get("status") or {}).get("conditions") or [], k.READY)
    if cond is None or cond.get("status") != "False":
        return None
    meta = policy.get("metadata") or {}
    return (
        f"CheckpointPolicy {meta.get('namespace')}/{meta.get('name')} is not Ready "
        f"({cond.get('reason')}): {cond.get('message')}"
    )


def _strata(message: str) -> str:
    """``message`` with the "Strata: " prefix every denial carries (once)."""
    return message if message.startswith(DENIAL_PREFIX) else DENIAL_PREFIX + message


def _apply_ops(ops: list[dict[str, Any]], raw_body: dict[str, Any]) -> None:
    jsonpatch.apply_patch(raw_body, ops, in_place=True)


Builder = Callable[
    [dict[str, Any], dict[str, Any], WebhookState, str, dict[str, Any] | None],
    list[dict[str, Any]],
]


async def _admit(
    kind: str,
    body: Mapping[str, Any],
    warnings: list[str],
    state: WebhookState,
    build: Builder,
    policy_of: Callable[[dict[str, Any]], str | None],
    dryrun: bool = False,
) -> list[dict[str, Any]]:
    """Decide one admission: the JSON patch ops, or ``kopf.AdmissionError`` (4xx) saying why.
    ``dryrun``: the request is a dry run; its one side effect (the peer Secret) is skipped."""
    start = time.perf_counter()
    outcome = "error"
    try:
        raw = copy.deepcopy(dict(body))
        namespace = (raw.get("metadata") or {}).get("namespace") or "default"
        policy_name = policy_of(raw)
        if policy_name is None:
            outcome = "unchanged"
            return []
        if kind == "Pod" and pod_checks.fully_injected(raw):
            # Reinvocation (the API server calls again after later admission plugins changed the
            # pod, e.g. the ServiceAccount plugin mounting a token into our sidecar): nothing to
            # add, so no policy read and no work.
            outcome = "reinvoked"
            return []
        policy = await state.get_policy(namespace, policy_name)
        peers = kind == "Pod" and peer_admission.wants_peers(policy)
        timeout = max(1, state.options.timeout_seconds - 2)
        workload = None
        if peers:
            workload = await state.peers.pod_workload(
                raw, namespace, state.custom_api, state.batch_api, timeout
            )
        try:
            # On the event loop whatever the job's size: a pod carries its peers as name
            # patterns (O(replicated jobs)), and the one O(pods) check is done once per workload
            # (sidecar_config caches it). A thread cost more than the build: under a 512-pod
            # burst the wait for one of the default executor reached 330 ms.
            ops = build(raw, policy, state, namespace, workload)
            if peers:
                job_id = job_id_for(raw, namespace)
        except InjectionError as exc:
            raise kopf.AdmissionError(str(exc), code=DENY_INVALID) from None
        if peers and not dryrun:
            await state.peers.ensure_peer_secret(job_id, namespace, policy, state.core_api, timeout)
        warning = _not_ready_warning(policy)
        if warning:
            warnings.append(warning)
        outcome = ("injected" if kind == "Pod" else "labelled") if ops else "unchanged"
        return ops
    except kopf.AdmissionError as exc:
        code = exc.code or DENY_INVALID
        outcome = "denied" if code < 500 else "error"
        raise kopf.AdmissionError(_strata(str(exc)), code=code) from None
    except Exception as exc:
        # Never a 5xx for a policy the API accepted: a bug here refuses the object with a
        # message instead of an opaque webhook failure (and counts as outcome "error").
        log.exception("admission of a %s failed", kind)
        raise kopf.AdmissionError(
            _strata(
                f"internal error while mutating the {kind} ({type(exc).__name__}: {exc}); "
                f"this is a bug in Strata, please report it; meanwhile remove the "
                f"{POLICY_LABEL} label/annotation to create the {kind} without Strata"
            ),
            code=DENY_INVALID,
        ) from None
    finally:
        m.ADMISSION_REQUESTS.labels(kind=kind, outcome=outcome).inc()
        m.ADMISSION_DURATION.labels(kind=kind).observe(time.perf_counter() - start)
        memory.TRIMMER.closed()


async def _admit_into(
    kind: str,
    body: kopf.Body,
    patch: kopf.Patch,
    warnings: list[str],
    state: WebhookState,
    build: Builder,
    policy_of: Callable[[dict[str, Any]], str | None],
    dryrun: bool,
) -> None:
    ops = await _admit(kind, body, warnings, state, build, policy_of, dryrun)
    if ops:
        # kopf diffs the body before/after these functions into the response's JSON patch.
        patch.fns.append(functools.partial(_apply_ops, ops))


def _policy_in(field: str) -> Callable[[dict[str, Any]], str | None]:
    """The policy an object names under ``POLICY_LABEL`` in its ``metadata.<field>`` (a pod's
    ``labels``, a workload's ``annotations``); None when it names none."""

    def policy_of(raw: dict[str, Any]) -> str | None:
        value = ((raw.get("metadata") or {}).get(field) or {}).get(POLICY_LABEL)
        return None if value is None else str(value)

    return policy_of


_pod_policy = _policy_in("labels")
_workload_policy = _policy_in("annotations")


def _build_pod(
    raw: dict[str, Any],
    policy: dict[str, Any],
    state: WebhookState,
    namespace: str,
    workload: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    return build_pod_patch(raw, policy, state.injection, namespace=namespace, workload=workload)


def _build_workload(raw: dict[str, Any], *_: object) -> list[dict[str, Any]]:
    """A workload's patch depends on the workload alone (:func:`build_workload_patch`)."""
    return build_workload_patch(raw)


HANDLERS: dict[str, tuple[str, Builder, Callable[[dict[str, Any]], str | None]]] = {
    POD_WEBHOOK: ("Pod", _build_pod, _pod_policy),
    "label-jobs": ("Job", _build_workload, _workload_policy),
    "label-jobsets": ("JobSet", _build_workload, _workload_policy),
    "label-pytorchjobs": ("PyTorchJob", _build_workload, _workload_policy),
}


async def review_directly(
    state: WebhookState, review: dict[str, Any], handler_id: str | None
) -> dict[str, Any]:
    """Answer an AdmissionReview without kopf's resource dispatch (see ManagedWebhookServer)."""
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    entry = HANDLERS.get(handler_id or "")
    body = request.get("object")
    warnings: list[str] = []
    if entry is not None and isinstance(body, dict) and request.get("operation") == "CREATE":
        kind, build, policy_of = entry
        try:
            ops = await _admit(
                kind, body, warnings, state, build, policy_of, bool(request.get("dryRun"))
            )
        except kopf.AdmissionError as exc:
            response["allowed"] = False
            response["status"] = {"message": str(exc), "code": exc.code or 500}
        else:
            if ops:
                encoded = base64.b64encode(json.dumps(ops).encode()).decode("ascii")
                response["patch"] = encoded
                response["patchType"] = "JSONPatch"
    if warnings:
        response["warnings"] = warnings
    return {
        "apiVersion": review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": review.get("kind", "AdmissionReview"),
        "response": response,
    }


def _short_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


class Webhook:
    """The admission role (an :class:`strata_operator.extension.Extension`): the pod and workload
    webhooks, the policy cache that feeds them, and the HTTPS server that writes the webhook
    configuration. Its run-time state is :attr:`state` (set by :meth:`configure`)."""

    name = "webhook"
    leader_only = False
    """Runs on every replica: admission is stateless, each replica has its own policy cache."""

    def __init__(self, state: WebhookState | None = None) -> None:
        self.state = state

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("admission webhook")
        g.add_argument("--webhook-port", type=int, default=9443, help="HTTPS port (default 9443)")
        g.add_argument("--webhook-listen", default="0.0.0.0", help="bind address (default 0.0.0.0)")
        g.add_argument(
            "--webhook-host",
            default="127.0.0.1",
            help="host the apiserver uses in the webhook URL (default 127.0.0.1; local control "
            "plane); ignored with --webhook-service",
        )
        g.add_argument(
            "--webhook-service",
            metavar="NS/NAME[:PORT]",
            help="reach the webhook through this Service (in-cluster) instead of a URL",
        )
        g.add_argument("--webhook-config-name", default="strata.dev")
        g.add_argument(
            "--failure-policy",
            choices=("Fail", "Ignore"),
            default=os.environ.get("STRATA_FAILURE_POLICY", "Fail"),
            help="when the webhook is unreachable: Fail refuses training pods, Ignore lets them "
            "run unprotected (reported) (default %(default)s)",
        )
        g.add_argument("--webhook-timeout", type=int, default=5, metavar="SECONDS")
        g.add_argument(
            "--operator-namespace",
            default=os.environ.get("POD_NAMESPACE", "strata-system"),
            help="the operator's namespace, never sent to the webhook (default $POD_NAMESPACE)",
        )
        g.add_argument(
            "--exclude-namespace",
            action="append",
            default=[],
            help="another namespace never sent to the webhook (repeatable; kube-system always is)",
        )
        g.add_argument(
            "--no-manage-webhook",
            action="store_true",
            help="do not write the MutatingWebhookConfiguration (a chart owns it)",
        )
        g.add_argument("--sidecar-image", default=os.environ.get("STRATA_SIDECAR_IMAGE"))
        g.add_argument(
            "--sidecar-memory-overhead",
            default="256Mi",
            help="sidecar memory on top of the RAM tier (default %(default)s)",
        )

    def configure(self, args: argparse.Namespace, wiring: Wiring) -> None:
        """Build the webhook state (options, injection settings, API clients) from the flags
        and the shared TLS files and report endpoint."""
        from kubernetes import client

        opts = WebhookOptions(
            listen_host=args.webhook_listen,
            port=args.webhook_port,
            url_host=args.webhook_host,
            service=args.webhook_service,
            configuration_name=args.webhook_config_name,
            failure_policy=args.failure_policy,
            timeout_seconds=args.webhook_timeout,
            excluded_namespaces=("kube-system", *args.exclude_namespace),
            operator_namespace=args.operator_namespace,
            manage_configuration=not args.no_manage_webhook,
        )
        report = wiring.report
        injection = InjectionSettings(
            **({"sidecar_image": args.sidecar_image} if args.sidecar_image else {}),
            report_endpoint=report.url if report else None,
            report_audience=report.audience if report else "strata.dev",
            report_ca_pem=wiring.tls.ca_pem if report else None,
            memory_overhead=args.sidecar_memory_overhead,
        )
        self.state = WebhookState(
            options=opts,
            injection=injection,
            tls=wiring.tls,
            custom_api=client.CustomObjectsApi(),
            admission_api=client.AdmissionregistrationV1Api(),
            core_api=client.CoreV1Api(),
            batch_api=client.BatchV1Api(),
            namespaces=tuple(getattr(args, "namespace", None) or ()),
        )

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """The startup handler that installs the server, the policy watch of the cache, and
        one ``on.mutate`` handler per webhook (ids: :data:`HANDLERS`)."""
        state = self._state()
        kopf.on.startup(id="start_webhook_server", registry=registry)(self.start_server)
        kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, id="policy_event", registry=registry)(
            state.policies.policy_event
        )
        kopf.on.mutate(
            "",
            "v1",
            "pods",
            id=POD_WEBHOOK,
            operations=["CREATE"],
            labels={POLICY_LABEL: kopf.PRESENT},
            registry=registry,
        )(self._handler(POD_WEBHOOK))
        for handler_id, (group, version, plural) in WORKLOAD_WEBHOOKS.items():
            kopf.on.mutate(
                group, version, plural, id=handler_id, operations=["CREATE"], registry=registry
            )(self._handler(handler_id))

    def _state(self) -> WebhookState:
        if self.state is None:
            raise RuntimeError("Webhook used before configure(); run it via main.run()")
        return self.state

    def _handler(self, handler_id: str) -> Callable[..., Coroutine[Any, Any, None]]:
        """The ``on.mutate`` handler of one webhook: decide, then let kopf diff the patch in."""
        kind, build, policy_of = HANDLERS[handler_id]
        state = self._state()

        async def admit(
            body: kopf.Body,
            patch: kopf.Patch,
            warnings: list[str],
            dryrun: bool = False,
            **_: Any,
        ) -> None:
            await _admit_into(kind, body, patch, warnings, state, build, policy_of, dryrun)

        admit.__name__ = admit.__qualname__ = handler_id.replace("-", "_")
        admit.__doc__ = (
            "Inject the Strata sidecar, volumes, env and mounts into a labelled pod."
            if kind == "Pod"
            else f"Label the pod templates of a {kind} annotated with a policy."
        )
        return admit

    async def start_server(self, settings: kopf.OperatorSettings, **_: Any) -> None:
        """Point kopf at our HTTPS server; the configuration is ours, not kopf's (module
        docstring)."""
        state = self._state()
        opts = state.options
        if state.watch is None:
            state.watch = PolicyWatch(
                state.policies, state.custom_api, asyncio.get_running_loop(), state.namespaces
            )
            state.watch.start()

        async def write_config(ca_bundle: bytes, base_url: str | None) -> None:
            body = build_webhook_configuration(opts, ca_bundle=ca_bundle, base_url=base_url)
            await asyncio.to_thread(apply_webhook_configuration, state.admission_api, body)
            log.info(
                "MutatingWebhookConfiguration %s written (failurePolicy %s, caBundle sha %s)",
                opts.configuration_name,
                opts.failure_policy,
                _short_digest(ca_bundle),
            )

        settings.admission.server = ManagedWebhookServer(
            addr=opts.listen_host,
            port=opts.port,
            host=opts.url_host,
            certfile=str(state.tls.certfile),
            pkeyfile=str(state.tls.keyfile),
            cafile=str(state.tls.cafile),
            write_config=write_config if opts.manage_configuration else None,
            fallback=functools.partial(review_directly, state),
        )
        settings.admission.managed = None
