"""Folding sidecar reports into CheckpointPolicy.status.jobs[] (pure) and the events it yields."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from strata.reports import FlushEstimate, ReportedError, Restore, SidecarReport, TierState
from strata_operator.api import CheckpointPolicyStatus
from strata_operator.reports.fold import FLUSH_STALE_SECONDS, fold_report, with_flush_condition

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=UTC)


def report(job: str = "ns.train", pod: str = "train-0", **kw: object) -> SidecarReport:
    return SidecarReport(policy="fast", namespace="ns", pod_name=pod, job_id=job, **kw)


def test_first_report_creates_the_job_entry_with_steps_restore_and_error() -> None:
    jobs, events = fold_report(
        [],
        report(
            tiers={
                "ram": TierState(newest_complete_step=40),
                "pvc": TierState(newest_complete_step=30),
            },
            restores=[Restore(tier="pvc", step=30, seconds=1.5, bytes=10, rank=1, time=T0)],
            errors=[ReportedError(tier="gcs", message="timeout", time=T0)],
        ),
        now=T0 + timedelta(seconds=2),
    )
    assert jobs == [
        {
            "jobId": "ns.train",
            "newestCompleteStep": {"ram": 40, "pvc": 30},
            "lastRestore": {
                "tier": "pvc",
                "step": 30,
                "seconds": 1.5,
                "outcome": "restored",
                "time": "2026-11-30T10:00:00Z",
            },
            "lastError": {"tier": "gcs", "message": "timeout", "time": "2026-11-30T10:00:00Z"},
            "updateTime": "2026-11-30T10:00:02Z",
        }
    ]
    CheckpointPolicyStatus.model_validate({"jobs": jobs})  # what the CRD schema accepts
    assert [(e.type, e.reason) for e in events] == [
        ("Normal", "Restored"),
        ("Warning", "TierFailed"),
    ]
    assert "rank 1 restored step 30 from tier pvc" in events[0].message


def test_newest_report_wins_per_tier_and_missing_tiers_keep_their_value() -> None:
    jobs, _ = fold_report(
        [],
        report(
            tiers={
                "ram": TierState(newest_complete_step=9),
                "pvc": TierState(newest_complete_step=8),
            }
        ),
        now=T0,
    )
    jobs, _ = fold_report(jobs, report(tiers={"ram": TierState(newest_complete_step=None)}), now=T0)
    jobs, _ = fold_report(jobs, report(tiers={"ram": TierState(newest_complete_step=3)}), now=T0)
    assert jobs[0]["newestCompleteStep"] == {"ram": 3, "pvc": 8}


def test_ranks_restoring_in_the_same_second_each_get_an_event_and_resends_keep_keys() -> None:
    r1 = report(
        pod="train-1",
        restores=[Restore(tier="pvc", step=11, rank=1, time=T0 + timedelta(microseconds=200))],
    )
    r0 = report(
        pod="train-0",
        restores=[Restore(tier="ram", step=11, rank=0, time=T0 + timedelta(microseconds=900))],
    )
    jobs, ev1 = fold_report([], r1, now=T0)
    jobs, ev0 = fold_report(jobs, r0, now=T0)
    assert [e.reason for e in ev1 + ev0] == ["Restored", "Restored"]
    assert ev1[0].key != ev0[0].key
    _, again = fold_report(jobs, r0, now=T0)
    assert [e.key for e in again] == [ev0[0].key]  # the receiver posts each key once


def test_older_restores_do_not_replace_the_last_one() -> None:
    jobs, _ = fold_report([], report(restores=[Restore(tier="ram", step=20, time=T0)]), now=T0)
    jobs, events = fold_report(
        jobs, report(restores=[Restore(tier="gcs", step=5, time=T0 - timedelta(hours=1))]), now=T0
    )
    assert jobs[0]["lastRestore"]["step"] == 20 and events == []


def test_fresh_start_and_failure_are_warnings() -> None:
    _, events = fold_report(
        [],
        report(
            restores=[
                Restore(tier=None, step=None, outcome="fresh-start", time=T0),
                Restore(tier=None, step=None, outcome="failed", time=T0 + timedelta(seconds=1)),
            ]
        ),
        now=T0,
    )
    assert [(e.type, e.reason) for e in events] == [
        ("Warning", "FreshStart"),
        ("Warning", "RestoreFailed"),
    ]


def test_jobs_are_bounded_newest_first() -> None:
    jobs: list[dict[str, object]] = []
    for i in range(40):
        jobs, _ = fold_report(
            jobs, report(job=f"ns.j{i}"), now=T0 + timedelta(seconds=i), max_jobs=32
        )
    assert len(jobs) == 32
    assert jobs[0]["jobId"] == "ns.j39" and jobs[-1]["jobId"] == "ns.j8"
    jobs, _ = fold_report(jobs, report(job="ns.j20"), now=T0 + timedelta(seconds=99), max_jobs=32)
    assert jobs[0]["jobId"] == "ns.j20" and len(jobs) == 32


def test_a_restore_from_peers_folds_into_status_and_events_as_peer() -> None:
    """Issue 16: the replacement of a lost node restores from other nodes' RAM; the status (and
    the CRD's enum) and the Event name the tier ``peer``."""
    jobs, events = fold_report(
        [],
        report(
            pod="train-1",
            restores=[Restore(tier="peer", step=130, seconds=0.4, bytes=10, rank=1, time=T0)],
            errors=[ReportedError(tier="peer", message="corrupt copy skipped", time=T0)],
        ),
        now=T0,
    )
    assert jobs[0]["lastRestore"]["tier"] == "peer"
    assert jobs[0]["lastError"]["tier"] == "peer"
    CheckpointPolicyStatus.model_validate({"jobs": jobs})
    assert "rank 1 restored step 130 from tier peer" in events[0].message


def test_a_tier_too_small_for_keep_plus_one_shows_in_status_until_it_takes_a_step_again() -> None:
    """Issue 11, failure 8: the sidecar's ``too_small`` reaches the policy status (and one
    Warning Event when it starts); a later report without it clears it."""
    msg = "a step needs 4194304 bytes, the tier has 2097152 free with keep 1"
    jobs, events = fold_report(
        [],
        report(tiers={"pvc": TierState(newest_complete_step=10, too_small=msg)}),
        now=T0,
    )
    assert jobs[0]["tooSmall"] == {"pvc": msg}
    assert [e.reason for e in events] == ["TierTooSmall"]
    assert "tier pvc cannot hold keep + 1 steps" in events[0].message
    CheckpointPolicyStatus.model_validate({"jobs": jobs})
    # The same condition again: still shown, no second Event.
    jobs, events = fold_report(
        jobs, report(tiers={"pvc": TierState(newest_complete_step=10, too_small=msg)}), now=T0
    )
    assert jobs[0]["tooSmall"] == {"pvc": msg} and events == []
    # Another tier's report leaves it; the PVC taking a step again clears it.
    jobs, _ = fold_report(jobs, report(tiers={"ram": TierState(newest_complete_step=20)}), now=T0)
    assert jobs[0]["tooSmall"] == {"pvc": msg}
    jobs, _ = fold_report(jobs, report(tiers={"pvc": TierState(newest_complete_step=20)}), now=T0)
    assert "tooSmall" not in jobs[0]


# -- termination flush estimates ------------------------------------------------------------------


def estimate(needed: float | None, grace: float = 30.0, **kw: object) -> FlushEstimate:
    rate = None if needed is None else 2**28 / needed
    fields: dict[str, object] = {
        "tier": "pvc",
        "state_bytes": 2**28,
        "bytes_per_second": rate,
        "seconds_needed": needed,
        "grace_seconds": grace,
        "budget_seconds": grace - 5.0,
        "fits": None if needed is None else needed <= grace - 5.0,
    }
    fields.update(kw)
    return FlushEstimate.model_validate(fields)


def test_a_flush_that_fits_sets_the_condition_true_without_an_event() -> None:
    jobs, events = fold_report([], report(flush=estimate(4.0), time=T0), now=T0)
    flush = jobs[0]["flush"]
    assert flush["pod"] == "train-0"
    assert (flush["secondsNeeded"], flush["budgetSeconds"], flush["fits"]) == (4.0, 25.0, True)
    assert flush["stateBytes"] == 2**28 and flush["graceSeconds"] == 30.0
    CheckpointPolicyStatus.model_validate({"jobs": jobs})
    assert events == []
    conds = with_flush_condition([], jobs, now=T0)
    assert conds is not None
    assert [(x["type"], x["status"], x["reason"]) for x in conds] == [
        ("FlushFitsGracePeriod", "True", "FlushFits")
    ]
    CheckpointPolicyStatus.model_validate({"jobs": jobs, "conditions": conds})
    # The same again changes nothing: no status write for the condition.
    assert with_flush_condition(conds, jobs, now=T0 + timedelta(seconds=9)) is None


def test_a_flush_too_slow_for_the_grace_period_is_a_false_condition_and_one_warning() -> None:
    jobs, events = fold_report([], report(flush=estimate(4.0), time=T0), now=T0)
    before = with_flush_condition([], jobs, now=T0)
    assert before is not None
    later = T0 + timedelta(seconds=10)
    jobs, events = fold_report(jobs, report(flush=estimate(41.25), time=later), now=later)
    assert [(e.type, e.reason) for e in events] == [("Warning", "FlushTooSlow")]
    assert "needs 41.2 s" in events[0].message
    assert "terminationGracePeriodSeconds to at least 47" in events[0].message
    conds = with_flush_condition(before, jobs, now=later)
    assert conds is not None
    (cond,) = conds
    assert (cond["status"], cond["reason"]) == ("False", "FlushTooSlow")
    assert "needs 41.25 s" in cond["message"] and "leaves 25.0 s" in cond["message"]
    assert cond["lastTransitionTime"] == "2026-11-30T10:00:10Z"
    # Still too slow: no second event.
    again = later + timedelta(seconds=10)
    _, events = fold_report(jobs, report(flush=estimate(40.0), time=again), now=again)
    assert events == []


def test_the_pod_needing_the_largest_share_of_its_budget_is_kept_for_the_job() -> None:
    jobs, _ = fold_report([], report(pod="train-0", flush=estimate(20.0), time=T0), now=T0)
    t1 = T0 + timedelta(seconds=5)
    jobs, _ = fold_report(jobs, report(pod="train-1", flush=estimate(3.0), time=t1), now=t1)
    assert jobs[0]["flush"]["pod"] == "train-0"
    # The same pod's own newer figure replaces its older one, larger or not.
    t2 = T0 + timedelta(seconds=10)
    jobs, _ = fold_report(jobs, report(pod="train-0", flush=estimate(2.0), time=t2), now=t2)
    assert jobs[0]["flush"]["secondsNeeded"] == 2.0
    # A pod gone quiet for long (deleted) gives way to any other pod's figures.
    t3 = t2 + timedelta(seconds=FLUSH_STALE_SECONDS + 1)
    jobs, _ = fold_report(jobs, report(pod="train-2", flush=estimate(1.0), time=t3), now=t3)
    assert jobs[0]["flush"]["pod"] == "train-2"


def test_a_missed_termination_flush_is_a_warning_and_a_false_condition() -> None:
    missed = estimate(10.0, last_ok=True, last_fit=False, last_step=40, last_seconds=27.5)
    jobs, events = fold_report([], report(flush=missed, time=T0), now=T0)
    assert [(e.type, e.reason) for e in events] == [("Warning", "FlushMissedDeadline")]
    assert "step 40" in events[0].message
    conds = with_flush_condition([], jobs, now=T0)
    assert conds is not None
    assert (conds[0]["status"], conds[0]["reason"]) == ("False", "FlushMissedDeadline")


def test_reports_with_and_without_flush_are_both_accepted_and_fold() -> None:
    """Version skew: sidecars of older versions send no ``flush``; this operator takes both."""
    old_sidecar = report(tiers={"pvc": TierState(newest_complete_step=5)}).model_dump_json(
        exclude={"flush"}
    )
    assert "flush" not in json.loads(old_sidecar)
    parsed = SidecarReport.model_validate_json(old_sidecar)
    jobs, _ = fold_report([], parsed, now=T0)
    assert "flush" not in jobs[0] and with_flush_condition([], jobs) is None
    # A sidecar that measured nothing yet sends figures without a verdict: nothing changes.
    jobs, _ = fold_report(jobs, report(flush=estimate(None)), now=T0)
    assert "flush" not in jobs[0]
    new_sidecar = report(flush=estimate(4.0)).model_dump_json()
    jobs, _ = fold_report(jobs, SidecarReport.model_validate_json(new_sidecar), now=T0)
    assert jobs[0]["flush"]["fits"] is True
    # A later report without flush keeps the figures it had.
    jobs, _ = fold_report(jobs, parsed, now=T0)
    assert jobs[0]["flush"]["fits"] is True and jobs[0]["newestCompleteStep"] == {"pvc": 5}
