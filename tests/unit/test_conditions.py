"""Conditions keep lastTransitionTime unless status changes; reconcile decisions are pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from strata_operator import constants as k
from strata_operator.api import conditions as c
from strata_operator.constants import PSS_ENFORCE_LABEL
from strata_operator.reconcile.policy import (
    BucketFact,
    Facts,
    InvalidSpec,
    PvcFact,
    SecretFact,
    evaluate,
    invalid,
    new_status,
    parse_spec,
)
from tests.fixtures.policies import PolicyBuilder

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def ready(status: c.ConditionStatus, reason: str = k.REASON_RECONCILED) -> c.NewCondition:
    return c.NewCondition(k.READY, status, reason, f"message for {reason}")


def test_new_condition_gets_now_as_transition_time() -> None:
    conds = c.set_condition([], ready("True"), generation=1, now=T0)
    assert conds == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Reconciled",
            "message": "message for Reconciled",
            "lastTransitionTime": "2026-01-02T03:04:05Z",
            "observedGeneration": 1,
        }
    ]


def test_same_status_keeps_transition_time_but_takes_new_reason_and_generation() -> None:
    first = c.set_condition([], ready("False", k.REASON_PVC_NOT_FOUND), generation=1, now=T0)
    second = c.set_condition(first, ready("False", k.REASON_PVC_LOST), generation=2, now=T1)
    assert second[0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert second[0]["reason"] == "PvcLost" and second[0]["observedGeneration"] == 2


def test_status_change_moves_transition_time() -> None:
    first = c.set_condition([], ready("False", k.REASON_PVC_NOT_FOUND), generation=1, now=T0)
    second = c.set_condition(first, ready("True"), generation=1, now=T1)
    assert second[0]["lastTransitionTime"] == "2026-01-02T03:09:05Z"
    assert c.is_true(second, k.READY)


def test_other_conditions_and_order_are_kept() -> None:
    other = {
        "type": "Custom",
        "status": "True",
        "reason": "X",
        "message": "",
        "lastTransitionTime": "t",
    }
    conds = c.set_conditions(
        [other],
        [ready("True"), c.NewCondition(k.DEGRADED, "False", k.REASON_AS_EXPECTED, "")],
        generation=1,
        now=T0,
    )
    assert [x["type"] for x in conds] == ["Custom", "Ready", "Degraded"]
    assert conds[0] == other


def test_unknown_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown condition reason"):
        c.NewCondition(k.READY, "True", "not-camel", "")


def test_reasons_are_camel_case() -> None:
    for reason in k.CONDITION_REASONS:
        assert reason[0].isupper() and reason.isalnum(), reason


# --- reconcile decisions ----------------------------------------------------------------------


def spec_of(builder: PolicyBuilder):  # type: ignore[no-untyped-def]
    return parse_spec(builder.spec())


def test_ram_only_policy_is_ready_and_not_degraded() -> None:
    out = evaluate(spec_of(PolicyBuilder()), Facts(), "team-a")
    assert (out.ready.status, out.ready.reason) == ("True", k.REASON_RECONCILED)
    assert (out.degraded.status, out.degraded.reason) == ("False", k.REASON_AS_EXPECTED)
    assert out.error is None


def test_missing_pvc_is_not_ready_and_retried() -> None:
    out = evaluate(
        spec_of(PolicyBuilder().pvc("ckpt")),
        Facts(pvc=PvcFact(found=False)),
        "team-a",
        dependency_retry=7,
    )
    assert (out.ready.status, out.ready.reason) == ("False", k.REASON_PVC_NOT_FOUND)
    assert "'ckpt'" in out.ready.message and "spec.tiers.pvc.claimName" in out.ready.message
    assert out.error is not None and out.error.retry_after == 7


def test_rwo_pvc_is_ready_but_degraded() -> None:
    facts = Facts(pvc=PvcFact(found=True, phase="Bound", access_modes=("ReadWriteOnce",)))
    out = evaluate(spec_of(PolicyBuilder().pvc("ckpt")), facts, "team-a")
    assert out.ready.status == "True"
    assert (out.degraded.status, out.degraded.reason) == ("True", k.REASON_PVC_NOT_SHARED)
    assert "ReadWriteMany" in out.degraded.message


def test_pending_pvc_is_degraded_and_ready_says_so() -> None:
    """Ready stays True (a WaitForFirstConsumer claim binds only when the first pod, which a
    not-Ready policy would refuse, mounts it), its message and Degraded say the PVC is Pending."""
    facts = Facts(pvc=PvcFact(found=True, phase="Pending", access_modes=("ReadWriteMany",)))
    out = evaluate(spec_of(PolicyBuilder().pvc("ckpt")), facts, "team-a")
    assert out.ready.status == "True" and "PVC is Pending" in out.ready.message
    assert (out.degraded.status, out.degraded.reason) == ("True", k.REASON_PVC_PENDING)
    assert "'ckpt'" in out.degraded.message and "kubectl describe pvc ckpt -n team-a" in (
        out.degraded.message
    )
    bound = Facts(pvc=PvcFact(found=True, phase="Bound", access_modes=("ReadWriteMany",)))
    out = evaluate(spec_of(PolicyBuilder().pvc("ckpt")), bound, "team-a")
    assert out.degraded.status == "False" and "Pending" not in out.ready.message


def test_lost_pvc_is_not_ready() -> None:
    facts = Facts(pvc=PvcFact(found=True, phase="Lost", access_modes=("ReadWriteMany",)))
    out = evaluate(spec_of(PolicyBuilder().pvc("ckpt")), facts, "team-a")
    assert out.ready.reason == k.REASON_PVC_LOST


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_host_path_in_a_namespace_refusing_host_path_is_not_ready(level: str) -> None:
    facts = Facts(namespace_labels={PSS_ENFORCE_LABEL: level})
    out = evaluate(spec_of(PolicyBuilder().ram(medium="HostPath")), facts, "team-a")
    assert out.ready.reason == k.REASON_HOST_PATH_FORBIDDEN
    assert "medium: Memory" in out.ready.message


def test_host_path_in_a_privileged_namespace_is_ready() -> None:
    facts = Facts(namespace_labels={PSS_ENFORCE_LABEL: "privileged"})
    out = evaluate(spec_of(PolicyBuilder().ram(medium="HostPath")), facts, "team-a")
    assert out.ready.status == "True"


@pytest.mark.parametrize(
    ("bucket", "reason"),
    [
        (BucketFact("not-found", "404"), k.REASON_BUCKET_NOT_FOUND),
        (BucketFact("unreachable", "timeout"), k.REASON_BUCKET_UNREACHABLE),
    ],
)
def test_bucket_problems_are_not_ready(bucket: BucketFact, reason: str) -> None:
    out = evaluate(spec_of(PolicyBuilder().gcs("my-ckpts")), Facts(bucket=bucket), "team-a")
    assert out.ready.reason == reason and "gs://my-ckpts" in out.ready.message


def test_unchecked_bucket_is_ready_and_says_so() -> None:
    facts = Facts(bucket=BucketFact("not-checked", "the operator has no Google credentials"))
    out = evaluate(spec_of(PolicyBuilder().gcs("my-ckpts")), facts, "team-a")
    assert out.ready.status == "True"
    assert out.degraded.reason == k.REASON_BUCKET_NOT_CHECKED
    assert "no Google credentials" in out.degraded.message


def test_missing_secret_key_is_not_ready() -> None:
    builder = PolicyBuilder().gcs(
        "my-ckpts", credentials={"type": "SecretRef", "secretRef": {"name": "gcs", "key": "sa"}}
    )
    out = evaluate(spec_of(builder), Facts(secret=SecretFact(found=True)), "team-a")
    assert out.ready.reason == k.REASON_SECRET_NOT_FOUND and "'sa'" in out.ready.message


def test_invalid_spec_outcome_is_permanent() -> None:
    try:
        parse_spec({"tiers": {"ram": {"sizeLimit": "1Gi", "keep": 0}}})
    except InvalidSpec as err:
        out = invalid(err)
    assert out.ready.reason == k.REASON_INVALID_SPEC and "spec.tiers.ram.keep" in out.ready.message
    assert out.error is not None and out.error.retry_after is None


def test_new_status_patches_only_conditions_and_generation() -> None:
    out = evaluate(spec_of(PolicyBuilder()), Facts(), "team-a")
    old = {"jobs": [{"jobId": "a.b"}], "conditions": []}
    first = new_status(old, out, generation=1, now=T0)
    assert set(first) == {"conditions", "observedGeneration"}
    second = new_status({**old, **first}, out, generation=2, now=T1)
    assert second["observedGeneration"] == 2
    assert [x["lastTransitionTime"] for x in second["conditions"]] == ["2026-01-02T03:04:05Z"] * 2
