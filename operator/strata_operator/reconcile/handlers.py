"""The reconcile role's kopf handlers: CheckpointPolicy create/update/resume and its dependencies.

Reconcile (create, update, resume): parse the spec, gather facts (namespace, PVC, Secret,
bucket), decide the conditions (:mod:`strata_operator.reconcile.policy`), write them with ONE
status patch (:meth:`strata_operator.cluster.StatusWriter.write_conditions`; ``status.jobs``
belongs to the report receiver and is left alone), then post the Event of a Ready change
(:class:`strata_operator.cluster.EventRecorder`, which aggregates a repeat into the first Event's
series) — only after the patch succeeded, and only when the
Ready condition changed or the spec generation did. Domain errors become ``kopf.PermanentError``
(only a spec change helps) or ``kopf.TemporaryError(delay=...)`` (a dependency may appear) here,
at the handler boundary, and nowhere else.

The status patch is made with the Kubernetes client rather than kopf's ``patch.status``: kopf
applies its patch after the handler returns, so "events after the patch succeeds" could not be
guaranteed.

Dependencies: a PVC (and, with ``--watch-secrets``, a Secret) that a policy names is watched;
when it is created, changed or deleted, the policies naming it are reconciled at once
(:mod:`strata_operator.reconcile.dependencies`), instead of at kopf's next retry.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kopf

from strata_operator import api, metrics
from strata_operator import constants as k
from strata_operator.api import conditions as c
from strata_operator.cluster import (
    ClusterWriteFailed,
    EventRecorder,
    EventSpec,
    StatusWriter,
    get_policy,
)
from strata_operator.extension import Wiring
from strata_operator.reconcile.dependencies import PVC, SECRET, DependencyIndex, Kind
from strata_operator.reconcile.facts import gather
from strata_operator.reconcile.policy import (
    InvalidSpec,
    Outcome,
    ReconcileError,
    evaluate,
    invalid,
    new_status,
    parse_spec,
)

log = logging.getLogger("strata.operator")

RECONCILE_HANDLER_ID = "reconcile_policy"
"""kopf's id of the create/update/resume handler; kopf keys its progress annotations on it, so it
stays the same across releases."""


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
    watch_secrets: bool = False
    """Watch Secrets too (needs list/watch on secrets), so a created credentials Secret makes
    its policy Ready at once."""


@dataclass(frozen=True)
class Clients:
    """The Kubernetes API clients of the reconcile."""

    core_v1: Any
    """``kubernetes.client.CoreV1Api``: namespaces, PVCs, Secrets, Events."""
    custom: Any
    """``kubernetes.client.CustomObjectsApi``: CheckpointPolicies."""
    events: EventRecorder
    """Events on policies (a Ready change)."""


Emit = Callable[[str, str, str], None]
"""Post an Event on the policy: (type, reason, message)."""


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


class PolicyReconciler:
    """The reconcile role (an :class:`strata_operator.extension.Extension`).

    Tests may build one with ``options`` and ``clients`` and call :meth:`reconcile_one`
    directly; ``main`` calls :meth:`configure` instead.
    """

    name = "reconcile"
    leader_only = True
    """Runs only on the replica holding the Lease (``--leader-elect``): it writes policies."""

    def __init__(self, options: Options | None = None, clients: Clients | None = None) -> None:
        self.options = options or Options()
        self.clients = clients
        self.dependencies = DependencyIndex()

    # --- the extension contract -------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("reconcile")
        g.add_argument(
            "--dependency-retry",
            type=float,
            default=Options.dependency_retry,
            metavar="SECONDS",
            help="seconds between checks of a missing PVC, Secret or bucket (default %(default)s)",
        )
        g.add_argument(
            "--gcs-timeout",
            type=float,
            default=Options.gcs_timeout,
            metavar="SECONDS",
            help="timeout of the bucket reachability check (default %(default)s)",
        )
        g.add_argument("--no-bucket-check", action="store_true", help="do not contact GCS at all")
        g.add_argument(
            "--watch-secrets",
            action="store_true",
            help="watch Secrets (needs list/watch on secrets) so that a created credentials "
            "Secret makes its policy Ready at once; without it, within --dependency-retry",
        )

    def configure(self, args: argparse.Namespace, wiring: Wiring) -> None:
        from kubernetes import client

        self.options = Options(
            dependency_retry=args.dependency_retry,
            gcs_timeout=args.gcs_timeout,
            check_bucket=not args.no_bucket_check,
            watch_secrets=args.watch_secrets,
        )
        self.clients = Clients(
            core_v1=client.CoreV1Api(),
            custom=client.CustomObjectsApi(),
            events=EventRecorder(action=k.ACTION_RECONCILE),
        )

    def register(self, registry: kopf.OperatorRegistry) -> None:
        on = (api.GROUP, api.VERSION, api.PLURAL)
        for decorator in (kopf.on.resume, kopf.on.create, kopf.on.update):
            decorator(*on, id=RECONCILE_HANDLER_ID, registry=registry)(self.reconcile_policy)
        kopf.on.event("", "v1", "persistentvolumeclaims", id="pvc_changed", registry=registry)(
            self.pvc_changed
        )
        if self.options.watch_secrets:
            kopf.on.event("", "v1", "secrets", id="secret_changed", registry=registry)(
                self.secret_changed
            )

    # --- handlers ---------------------------------------------------------------------------

    def reconcile_policy(
        self,
        *,
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        meta: kopf.Meta,
        namespace: str | None,
        name: str,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **_: Any,
    ) -> None:
        """Reconcile one CheckpointPolicy (see the module docstring). Returns None: nothing is
        stored in status by kopf."""
        assert namespace is not None  # the CRD is namespaced
        clients = self._clients()
        policy = dict(body)

        def emit(type_: str, reason: str, message: str) -> None:
            clients.events.post(policy, EventSpec(type_, reason, message))

        with metrics.timed_reconcile():
            problem = self.reconcile_one(
                dict(spec),
                dict(status),
                namespace,
                name,
                meta.get("generation"),
                emit,
                logger,
            )
        if problem is None:
            return
        if problem.retry_after is None:
            raise kopf.PermanentError(problem.message)
        raise kopf.TemporaryError(problem.message, delay=problem.retry_after)

    async def pvc_changed(
        self, name: str, namespace: str | None, type: str | None, **_: Any
    ) -> None:
        """A PVC appeared, changed or went away: re-check the policies that name it, at once."""
        if type is None or namespace is None:  # the initial listing: the reconciles see it anyway
            return
        await asyncio.to_thread(self.recheck_dependents, namespace, PVC, name)

    async def secret_changed(
        self, name: str, namespace: str | None, type: str | None, **_: Any
    ) -> None:
        """As :meth:`pvc_changed`, for credentials Secrets (registered with ``--watch-secrets``)."""
        if type is None or namespace is None:
            return
        await asyncio.to_thread(self.recheck_dependents, namespace, SECRET, name)

    # --- the work ---------------------------------------------------------------------------

    def _clients(self) -> Clients:
        if self.clients is None:
            raise RuntimeError("PolicyReconciler used before configure(); run it via main.run()")
        return self.clients

    def _decide(self, spec: dict[str, Any], namespace: str, name: str) -> Outcome:
        deps = self.dependencies
        try:
            parsed = parse_spec(spec, name=name)
        except InvalidSpec as err:
            deps.record(namespace, name, None)
            return invalid(err)
        deps.record(namespace, name, parsed)
        facts = gather(
            self._clients().core_v1,
            parsed,
            namespace,
            check_bucket=self.options.check_bucket,
            gcs_timeout=self.options.gcs_timeout,
        )
        return evaluate(parsed, facts, namespace, dependency_retry=self.options.dependency_retry)

    def reconcile_one(
        self,
        spec: dict[str, Any],
        old_status: dict[str, Any],
        namespace: str,
        name: str,
        generation: int | None,
        emit: Emit,
        logger: logging.Logger | logging.LoggerAdapter[Any],
    ) -> ReconcileError | None:
        """One reconcile: decide, ONE status patch, then the Event of a Ready change.

        Returns the problem that keeps the policy from Ready (None when Ready); raises
        ``kopf.TemporaryError`` when the API itself fails.
        """
        deps = self.dependencies
        writer = StatusWriter(self._clients().custom)
        with deps.lock(namespace, name):
            try:
                outcome = self._decide(spec, namespace, name)
                patch = new_status(old_status, outcome, generation=generation)
                if _changed(old_status, patch) and not writer.write_conditions(
                    namespace, name, patch
                ):
                    logger.info("policy is gone; nothing to reconcile")
                    deps.forget(namespace, name)
                    return None
            except ClusterWriteFailed as err:
                raise kopf.TemporaryError(err.message, delay=self.options.api_retry) from None
            except ReconcileError as err:
                # Neither the facts nor the status could be read: the API is the problem.
                raise kopf.TemporaryError(
                    err.message, delay=err.retry_after or self.options.api_retry
                ) from None
        ready = outcome.ready
        if _ready_changed(old_status, patch):
            emit("Normal" if ready.status == "True" else "Warning", ready.reason, ready.message)
        logger.info("Ready=%s (%s): %s", ready.status, ready.reason, ready.message)
        return outcome.error

    def recheck_dependents(self, namespace: str, kind: Kind, name: str) -> list[str]:
        """Reconcile every policy that names this PVC/Secret, now (it was created, changed or
        deleted); returns their names. Runs in a worker thread (blocking API calls)."""
        clients = self._clients()
        done = []
        for policy_name in self.dependencies.dependents(namespace, kind, name):
            policy = get_policy(clients.custom, namespace, policy_name)
            if policy is None:
                self.dependencies.forget(namespace, policy_name)
                continue

            def emit(
                type_: str, reason: str, message: str, policy: dict[str, Any] = policy
            ) -> None:
                clients.events.post(policy, EventSpec(type_, reason, message))

            try:
                self.reconcile_one(
                    dict(policy.get("spec") or {}),
                    dict(policy.get("status") or {}),
                    namespace,
                    policy_name,
                    (policy.get("metadata") or {}).get("generation"),
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
