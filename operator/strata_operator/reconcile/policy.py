"""Reconcile a CheckpointPolicy: validate what the schema cannot, check its dependencies, and
compute the new status.

Three steps, kept apart so that the decisions are pure and unit-testable:

1. :func:`parse_spec` validates the stored spec with the pydantic models (the same rules as the
   CRD's schema and CEL; objects stored before a stricter CRD, or with validation bypassed, are
   caught here). Failure: :class:`InvalidSpec`.
2. :func:`strata_operator.reconcile.facts.gather` reads what the decision needs from the
   cluster and GCS (effects, in their own module): the namespace's Pod Security labels, the
   PVC, the credentials Secret, whether the bucket answers.
3. :func:`evaluate` turns spec + :class:`Facts` into an :class:`Outcome` (conditions and whether
   and when to retry); :func:`new_status` renders the status patch.

Domain errors (:class:`ReconcileError` and subclasses) carry a reason constant and a message that
says what to fix; :mod:`strata_operator.reconcile.handlers` translates them into kopf errors at
the handler boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import ValidationError

from strata.errors import StrataError
from strata_operator import constants as k
from strata_operator.api import CheckpointPolicySpec, GcsTierSpec
from strata_operator.api import conditions as c
from strata_operator.api.validation import check_policy_name
from strata_operator.constants import PSS_ENFORCE_LABEL

PSS_NO_HOST_PATH = frozenset({"baseline", "restricted"})


class ReconcileError(StrataError):
    """A domain error of a reconcile: ``reason`` (a conditions constant) and a message."""

    def __init__(self, reason: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        """Seconds until a retry may help; None: only a change of the policy will help."""


class InvalidSpec(ReconcileError):
    """The spec breaks a rule; the message lists every broken field and what to write."""

    def __init__(self, message: str) -> None:
        super().__init__(k.REASON_INVALID_SPEC, message)


class ApiForbidden(ReconcileError):
    """The operator's service account may not read an object it checks (RBAC)."""


class ApiUnavailable(ReconcileError):
    """The Kubernetes API failed (5xx, connection); retry soon."""

    def __init__(self, message: str, retry_after: float = 10.0) -> None:
        super().__init__(k.REASON_API_ERROR, message, retry_after=retry_after)


def parse_spec(raw: Mapping[str, Any], *, name: str | None = None) -> CheckpointPolicySpec:
    """The validated spec; :class:`InvalidSpec` naming each bad field (``spec.tiers.ram.keep``).

    ``name``: the policy's ``metadata.name``, checked too when given (it must fit a label).
    """
    problems = []
    try:
        spec = CheckpointPolicySpec.model_validate(dict(raw))
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in ("spec", *err["loc"]))
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{loc}: {msg}")
    if name is not None:
        try:
            check_policy_name(name)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise InvalidSpec("invalid spec: " + "; ".join(problems))
    return spec


# --- facts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PvcFact:
    found: bool
    phase: str | None = None
    access_modes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SecretFact:
    found: bool
    has_key: bool = False
    key_json: str | None = field(default=None, repr=False)


BucketOutcome = Literal["ok", "not-found", "forbidden", "unreachable", "not-checked"]


@dataclass(frozen=True)
class BucketFact:
    outcome: BucketOutcome
    detail: str = ""


@dataclass(frozen=True)
class Facts:
    """What the cluster and GCS said; None for what the policy does not configure."""

    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    pvc: PvcFact | None = None
    secret: SecretFact | None = None
    bucket: BucketFact | None = None


# --- decision (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """The conditions to set and what the handler boundary does next."""

    ready: c.NewCondition
    degraded: c.NewCondition
    error: ReconcileError | None = None
    """Set when not Ready: the boundary raises it (permanent unless ``retry_after``)."""


def _not_ready(err: ReconcileError) -> Outcome:
    return Outcome(
        ready=c.NewCondition(k.READY, "False", err.reason, err.message),
        degraded=c.NewCondition(
            k.DEGRADED, "Unknown", k.REASON_NOT_EVALUATED, "not evaluated: the policy is not Ready"
        ),
        error=err,
    )


def invalid(err: InvalidSpec) -> Outcome:
    """The outcome of a spec that does not parse."""
    return _not_ready(err)


def evaluate(
    spec: CheckpointPolicySpec, facts: Facts, namespace: str, *, dependency_retry: float = 30.0
) -> Outcome:
    """Decide Ready/Degraded from the spec and the facts (pure).

    ``dependency_retry``: seconds after which a missing dependency (PVC, Secret, bucket, a
    namespace label) is checked again, since creating it does not touch the policy.
    """
    ram = spec.tiers.ram
    pss = facts.namespace_labels.get(PSS_ENFORCE_LABEL, "")
    if ram.medium == "HostPath" and pss in PSS_NO_HOST_PATH:
        return _not_ready(
            ReconcileError(
                k.REASON_HOST_PATH_FORBIDDEN,
                f"spec.tiers.ram.medium is HostPath but namespace {namespace!r} enforces the "
                f"{pss!r} Pod Security Standard, which refuses hostPath volumes; use medium: "
                "Memory or relax the namespace's pod-security.kubernetes.io/enforce label",
                retry_after=dependency_retry,
            )
        )
    degraded: list[tuple[str, str]] = []
    pending = False
    pvc = spec.tiers.pvc
    if pvc is not None and facts.pvc is not None:
        claim = f"PersistentVolumeClaim {pvc.claim_name!r} in namespace {namespace!r}"
        if not facts.pvc.found:
            return _not_ready(
                ReconcileError(
                    k.REASON_PVC_NOT_FOUND,
                    f"{claim} not found; create it (ReadWriteMany) or fix spec.tiers.pvc.claimName",
                    retry_after=dependency_retry,
                )
            )
        if facts.pvc.phase == "Lost":
            return _not_ready(
                ReconcileError(
                    k.REASON_PVC_LOST,
                    f"{claim} is Lost (its volume is gone); recreate the claim",
                    retry_after=dependency_retry,
                )
            )
        if facts.pvc.phase == "Pending":
            # Still Ready: with volumeBindingMode WaitForFirstConsumer the claim binds only once
            # a pod mounts it, and a not-Ready policy would refuse that very pod.
            pending = True
            degraded.append(
                (
                    k.REASON_PVC_PENDING,
                    f"{claim} is Pending (not bound to a volume yet): nothing can be promoted to "
                    "the PVC tier until it binds. A WaitForFirstConsumer StorageClass binds it "
                    "when the first pod mounts it; otherwise see kubectl describe pvc "
                    f"{pvc.claim_name} -n {namespace} (provisioner, capacity, StorageClass)",
                )
            )
        if "ReadWriteMany" not in facts.pvc.access_modes:
            modes = ", ".join(facts.pvc.access_modes) or "none"
            degraded.append(
                (
                    k.REASON_PVC_NOT_SHARED,
                    f"{claim} has access modes [{modes}], not ReadWriteMany: pods of a multi-node "
                    "job cannot all mount it; use a shared filesystem (Filestore, Lustre, NFS)",
                )
            )
    gcs = spec.tiers.gcs
    if gcs is not None:
        secret_ref = gcs.credentials.secret_ref
        if secret_ref is not None and facts.secret is not None and not facts.secret.has_key:
            what = (
                f"has no key {secret_ref.key!r}"
                if facts.secret.found
                else "not found in the namespace"
            )
            return _not_ready(
                ReconcileError(
                    k.REASON_SECRET_NOT_FOUND,
                    f"Secret {secret_ref.name!r} named by spec.tiers.gcs.credentials.secretRef "
                    f"{what}; create it with the service-account JSON key under that key",
                    retry_after=dependency_retry,
                )
            )
        bucket = facts.bucket or BucketFact("not-checked", "no check was made")
        bucket_err = _bucket_error(gcs, bucket, dependency_retry)
        if bucket_err is not None:
            return _not_ready(bucket_err)
        if bucket.outcome in ("not-checked", "forbidden"):
            degraded.append(
                (
                    k.REASON_BUCKET_NOT_CHECKED,
                    f"bucket gs://{gcs.bucket} was not verified: {bucket.detail}",
                )
            )
    tiers = ", ".join(spec.configured_tiers())
    if pending:
        tiers += " (the PVC is Pending: see Degraded)"
    ready = c.NewCondition(k.READY, "True", k.REASON_RECONCILED, f"policy is valid; tiers: {tiers}")
    if degraded:
        reason = degraded[0][0]
        message = "; ".join(m for _, m in degraded)
        return Outcome(ready, c.NewCondition(k.DEGRADED, "True", reason, message))
    return Outcome(
        ready, c.NewCondition(k.DEGRADED, "False", k.REASON_AS_EXPECTED, "every check passed")
    )


def _bucket_error(gcs: GcsTierSpec, fact: BucketFact, retry: float) -> ReconcileError | None:
    where = f"bucket gs://{gcs.bucket} (spec.tiers.gcs.bucket)"
    if fact.outcome == "not-found":
        return ReconcileError(
            k.REASON_BUCKET_NOT_FOUND,
            f"{where} does not exist; create it or fix the name ({fact.detail})",
            retry_after=retry,
        )
    if fact.outcome == "forbidden" and gcs.credentials.type == "SecretRef":
        return ReconcileError(
            k.REASON_BUCKET_FORBIDDEN,
            f"{where} refuses the service account of spec.tiers.gcs.credentials.secretRef; "
            f"grant it roles/storage.objectUser ({fact.detail})",
            retry_after=retry,
        )
    if fact.outcome == "unreachable":
        return ReconcileError(
            k.REASON_BUCKET_UNREACHABLE,
            f"{where} could not be reached: {fact.detail}",
            retry_after=retry,
        )
    return None


def new_status(
    old_status: Mapping[str, Any] | None,
    outcome: Outcome,
    *,
    generation: int | None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The status merge patch: ``observedGeneration`` and the whole ``conditions`` list.

    Other status fields (``jobs``, written by the report receiver) are not part of the patch.
    """
    old = list((old_status or {}).get("conditions") or [])
    conds = c.set_conditions(old, [outcome.ready, outcome.degraded], generation=generation, now=now)
    patch: dict[str, Any] = {"conditions": conds}
    if generation is not None:
        patch["observedGeneration"] = generation
    return patch
