"""The Strata operator (kopf): reconciles CheckpointPolicies; entry point ``run(argv)``.

``strata operator [flags]`` and ``python -m strata_operator [flags]`` both call :func:`run`.

Reconcile (create, update, resume): parse the spec, gather facts (namespace, PVC, Secret,
bucket), decide the conditions (``reconcile``), write them with ONE status patch (merge patch of
``observedGeneration`` and ``conditions`` on the status subresource; ``status.jobs`` belongs to
the report receiver and is left alone), then post Events — only after the patch succeeded, and
only when the Ready condition changed or the spec generation did. Domain errors become
``kopf.PermanentError`` (only a spec change helps) or ``kopf.TemporaryError(delay=...)`` (a
dependency may appear) here, at the handler boundary, and nowhere else.

The status patch is made with the Kubernetes client rather than kopf's ``patch.status``: kopf
applies its patch after the handler returns while Events queued in the handler are posted
concurrently, so "events after the patch succeeds" could not be guaranteed.

Dependencies: a PVC (and, with ``--watch-secrets``, a Secret) that a policy names is watched;
when it is created, changed or deleted, the policies naming it are reconciled at once
(:mod:`strata_operator.dependencies`), instead of at kopf's next retry.

Pods: kopf watches only pods labelled ``strata.dev/policy`` (a server-side label selector), so the
operator's memory does not grow with the cluster's other pods.

Kopf settings (see :func:`configure`): progress and diff-base in ``strata.dev/*`` annotations
(the diff base is a digest of the spec, see :class:`GenerationDiffBaseStorage`)
(nothing in status, handler results are not stored: the handler returns None); no finalizers —
kopf adds one only for non-optional deletion handlers and daemons/timers, and none are
registered (case C-13: deleting a namespace must never wait for the operator); kopf's own log
lines are not posted as Events (only CRITICAL ones), so a policy waiting for its PVC does not
collect an Event per retry.

Extensions (webhook, report receiver, metrics) register their kopf handlers by being imported:
list their module names in :data:`EXTENSION_MODULES`. A module may also define
``add_arguments(parser: argparse.ArgumentParser) -> None`` and
``configure(args: argparse.Namespace, memo: kopf.Memo) -> None``; :func:`run` calls them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import kopf

from strata_operator import api, metrics
from strata_operator import conditions as c
from strata_operator import constants as k
from strata_operator.constants import FIELD_MANAGER, FINALIZER, PERSISTENCE_PREFIX, POLICY_LABEL
from strata_operator.dependencies import PVC, SECRET, DependencyIndex, Kind
from strata_operator.fold import EventSpec
from strata_operator.receiver import post_event
from strata_operator.reconcile import (
    InvalidSpec,
    Outcome,
    ReconcileError,
    evaluate,
    gather,
    invalid,
    new_status,
    parse_spec,
)

EXTENSION_MODULES: tuple[str, ...] = ("strata_operator.webhook", "strata_operator.receiver")
"""Modules that register more kopf handlers on import (e.g. ``strata_operator.webhook``)."""

log = logging.getLogger("strata.operator")


@dataclass(frozen=True)
class Options:
    """Reconcile tuning, from the command line."""

    dependency_retry: float = 30.0
    """Seconds between checks of a missing dependency (PVC, Secret, bucket)."""
    api_retry: float = 10.0
    """Seconds before retrying after a Kubernetes API failure."""
    gcs_timeout: float = 10.0
    """Seconds the bucket check may take (connect + read)."""
    check_bucket: bool = True


@dataclass
class Clients:
    core_v1: Any
    custom: Any


class GenerationDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled-configuration annotation, holding a digest instead of the object.

    kopf decides "update" by comparing an object's *essence* with the last *successfully
    handled* one, which it stores as JSON in an annotation. Two changes to kopf's default:

    * The essence is ``metadata.generation`` plus the SHA-256 of the spec (about 120 bytes),
      not a copy of the spec, labels and annotations: a copy doubles the object's annotations,
      so a policy whose annotations (or spec) exceed half of Kubernetes' 256 KiB annotation
      limit could never be marked handled, and kopf would retry it forever. Labels and
      annotations do not change what the reconcile decides, so they are not part of it.
    * With the generation in the essence every spec change, reverts included, is an update:
      when a user breaks a policy (the handler is retrying) and reverts it before the retry,
      the spec equals the last handled one again and kopf would drop the pending update, leaving
      status at the broken generation forever.
    """

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        spec = json.dumps(body.get("spec") or {}, sort_keys=True, separators=(",", ":"))
        essence: dict[str, Any] = {"spec": {"sha256": hashlib.sha256(spec.encode()).hexdigest()}}
        generation = body.get("metadata", {}).get("generation")
        if generation is not None:
            essence["metadata"] = {"generation": generation}
        return cast(kopf.BodyEssence, essence)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Tune kopf and create the Kubernetes clients (same kubeconfig/in-cluster config as kopf)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=PERSISTENCE_PREFIX
    )
    settings.persistence.diffbase_storage = GenerationDiffBaseStorage(
        prefix=PERSISTENCE_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    # kopf would post its own log lines as Events, including "failed temporarily" on every
    # retry of a missing dependency; our Events (on a Ready change) already say it once.
    settings.posting.level = logging.CRITICAL
    # Only labelled pods are watched (server-side selector): the operator's memory and its
    # start-up list do not grow with the cluster's other pods.
    settings.watching.label_selectors["", "v1", "pods"] = POLICY_LABEL
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    settings.execution.max_workers = 8
    memo.setdefault("dependencies", DependencyIndex())
    if "clients" not in memo:
        from kubernetes import client, config

        config.load_config()  # type: ignore[no-untyped-call]
        memo["clients"] = Clients(core_v1=client.CoreV1Api(), custom=client.CustomObjectsApi())


def _reconcile(
    spec: dict[str, Any],
    namespace: str,
    name: str,
    opts: Options,
    clients: Clients,
    deps: DependencyIndex,
) -> Outcome:
    try:
        parsed = parse_spec(spec, name=name)
    except InvalidSpec as err:
        deps.record(namespace, name, None)
        return invalid(err)
    deps.record(namespace, name, parsed)
    facts = gather(
        clients.core_v1,
        parsed,
        namespace,
        check_bucket=opts.check_bucket,
        gcs_timeout=opts.gcs_timeout,
    )
    return evaluate(parsed, facts, namespace, dependency_retry=opts.dependency_retry)


def _patch_status(clients: Clients, namespace: str, name: str, patch: dict[str, Any]) -> bool:
    """Merge-patch the status subresource; False when the object is gone."""
    from kubernetes.client.exceptions import ApiException

    try:
        clients.custom.patch_namespaced_custom_object_status(
            api.GROUP,
            api.VERSION,
            namespace,
            api.PLURAL,
            name,
            {"status": patch},
            field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json",
            _request_timeout=30,
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise ReconcileError(
            k.REASON_API_ERROR, f"status patch failed: {exc.status} {exc.reason}", retry_after=10
        ) from None
    except OSError as exc:
        raise ReconcileError(
            k.REASON_API_ERROR, f"status patch failed: {exc}", retry_after=10
        ) from None
    return True


def _changed(old: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    old = old or {}
    return bool(
        old.get("observedGeneration") != patch.get("observedGeneration")
        or old.get("conditions") != patch.get("conditions")
    )


def _ready_changed(old: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    before = c.find((old or {}).get("conditions") or [], k.READY)
    after = c.find(patch["conditions"], k.READY)
    if before is None or after is None:
        return True
    return bool(
        before.get("status") != after.get("status")
        or before.get("reason") != after.get("reason")
        or before.get("observedGeneration") != after.get("observedGeneration")
    )


Emit = Callable[[str, str, str], None]
"""Post an Event on the policy: (type, reason, message)."""


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def reconcile_policy(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    namespace: str | None,
    name: str,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """Reconcile one CheckpointPolicy (see the module docstring). Returns None: nothing is
    stored in status by kopf."""
    opts: Options = memo.get("options") or Options()
    clients: Clients = memo["clients"]
    deps: DependencyIndex = memo["dependencies"]
    assert namespace is not None  # the CRD is namespaced

    def emit(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    with metrics.timed_reconcile():
        problem = _reconcile_and_report(
            dict(spec),
            dict(status),
            namespace,
            name,
            meta.get("generation"),
            opts,
            clients,
            deps,
            emit,
            logger,
        )
    if problem is None:
        return
    if problem.retry_after is None:
        raise kopf.PermanentError(problem.message)
    raise kopf.TemporaryError(problem.message, delay=problem.retry_after)


def _reconcile_and_report(
    spec: dict[str, Any],
    old_status: dict[str, Any],
    namespace: str,
    name: str,
    generation: int | None,
    opts: Options,
    clients: Clients,
    deps: DependencyIndex,
    emit: Emit,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> ReconcileError | None:
    """One reconcile: decide, ONE status patch, then the Event of a Ready change.

    Returns the problem that keeps the policy from Ready (None when Ready); raises
    ``kopf.TemporaryError`` when the API itself fails.
    """
    with deps.lock(namespace, name):
        try:
            outcome = _reconcile(spec, namespace, name, opts, clients, deps)
            patch = new_status(old_status, outcome, generation=generation)
            if _changed(old_status, patch) and not _patch_status(clients, namespace, name, patch):
                logger.info("policy is gone; nothing to reconcile")
                deps.forget(namespace, name)
                return None
        except ReconcileError as err:
            # Neither the facts nor the status could be read/written: the API is the problem.
            raise kopf.TemporaryError(
                err.message, delay=err.retry_after or opts.api_retry
            ) from None
    ready = outcome.ready
    if _ready_changed(old_status, patch):
        emit("Normal" if ready.status == "True" else "Warning", ready.reason, ready.message)
    logger.info("Ready=%s (%s): %s", ready.status, ready.reason, ready.message)
    return outcome.error


def recheck_dependents(memo: Any, namespace: str, kind: Kind, name: str) -> list[str]:
    """Reconcile every policy that names this PVC/Secret, now (it was created, changed or
    deleted); returns their names. Runs in a worker thread (blocking API calls)."""
    deps: DependencyIndex = memo["dependencies"]
    clients: Clients = memo["clients"]
    opts: Options = memo.get("options") or Options()
    done = []
    for policy_name in deps.dependents(namespace, kind, name):
        policy = _get_policy(clients, namespace, policy_name)
        if policy is None:
            deps.forget(namespace, policy_name)
            continue

        def emit(type_: str, reason: str, message: str, policy: dict[str, Any] = policy) -> None:
            post_event(clients.core_v1, policy, EventSpec(type_, reason, message))

        try:
            _reconcile_and_report(
                dict(policy.get("spec") or {}),
                dict(policy.get("status") or {}),
                namespace,
                policy_name,
                (policy.get("metadata") or {}).get("generation"),
                opts,
                clients,
                deps,
                emit,
                log,
            )
        except kopf.TemporaryError as err:
            log.warning(
                "re-check of %s/%s after %s %s: %s", namespace, policy_name, kind, name, err
            )
            continue
        done.append(policy_name)
    return done


def _get_policy(clients: Clients, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        obj: dict[str, Any] = clients.custom.get_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, _request_timeout=30
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return obj


@kopf.on.event("", "v1", "persistentvolumeclaims")
async def pvc_changed(
    name: str, namespace: str | None, memo: Any, type: str | None, **_: Any
) -> None:
    """A PVC appeared, changed or went away: re-check the policies that name it, at once."""
    if type is None or namespace is None:  # the initial listing: the reconciles see it anyway
        return
    await asyncio.to_thread(recheck_dependents, memo, namespace, PVC, name)


async def secret_changed(
    name: str, namespace: str | None, memo: Any, type: str | None, **_: Any
) -> None:
    """As :func:`pvc_changed`, for credentials Secrets (registered with ``--watch-secrets``)."""
    if type is None or namespace is None:
        return
    await asyncio.to_thread(recheck_dependents, memo, namespace, SECRET, name)


# --- command line -----------------------------------------------------------------------------


def _extensions() -> list[ModuleType]:
    return [importlib.import_module(name) for name in EXTENSION_MODULES]


def build_parser(extensions: Sequence[ModuleType] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata operator",
        description="Run the Strata operator (reconciles CheckpointPolicies).",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; kopf glob patterns allowed)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (default)"
    )
    parser.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then in-cluster config)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=os.environ.get("STRATA_OPERATOR_LIVENESS"),
        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8090/healthz (default: off)",
    )
    parser.add_argument(
        "--dependency-retry",
        type=float,
        default=Options.dependency_retry,
        metavar="SECONDS",
        help="seconds between checks of a missing PVC, Secret or bucket (default %(default)s)",
    )
    parser.add_argument(
        "--gcs-timeout",
        type=float,
        default=Options.gcs_timeout,
        metavar="SECONDS",
        help="timeout of the bucket reachability check (default %(default)s)",
    )
    parser.add_argument("--no-bucket-check", action="store_true", help="do not contact GCS at all")
    parser.add_argument(
        "--watch-secrets",
        action="store_true",
        help="watch Secrets (needs list/watch on secrets) so that a created credentials Secret "
        "makes its policy Ready at once; without it, within --dependency-retry",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    parser.add_argument("--debug", action="store_true", help="log at DEBUG")
    for ext in extensions:
        add = getattr(ext, "add_arguments", None)
        if add is not None:
            add(parser)
    return parser


def use_kubeconfig(path: str) -> None:
    """Make every later ``kubernetes.config.load_config()`` (ours, kopf's, the extensions') and
    kopf's login read ``path``.

    The kubernetes client reads ``$KUBECONFIG`` once, at import, into
    ``KUBE_CONFIG_DEFAULT_LOCATION`` (also re-exported by ``kubernetes.config``), and kopf imports
    it before any flag is parsed; so the module globals are updated along with the variable.
    """
    os.environ["KUBECONFIG"] = path
    for name in ("kubernetes.config", "kubernetes.config.kube_config"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "KUBE_CONFIG_DEFAULT_LOCATION"):
            setattr(module, "KUBE_CONFIG_DEFAULT_LOCATION", path)  # noqa: B010


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the operator until SIGINT/SIGTERM; returns the exit code."""
    extensions = _extensions()
    args = build_parser(extensions).parse_args(argv)
    if args.kubeconfig:
        use_kubeconfig(args.kubeconfig)
    kopf.configure(verbose=args.verbose, debug=args.debug)
    memo = kopf.Memo(
        options=Options(
            dependency_retry=args.dependency_retry,
            gcs_timeout=args.gcs_timeout,
            check_bucket=not args.no_bucket_check,
        )
    )
    for ext in extensions:
        hook = getattr(ext, "configure", None)
        if hook is not None:
            hook(args, memo)
    if args.watch_secrets:
        kopf.on.event("", "v1", "secrets")(secret_changed)
    namespaces = tuple(args.namespace)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        memo=memo,
    )
    return 0
