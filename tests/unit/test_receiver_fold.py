"""Folding sidecar reports into CheckpointPolicy.status.jobs[] (pure) and the events it yields."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from strata.reports import ReportedError, Restore, SidecarReport, TierState
from strata_operator.api import CheckpointPolicyStatus
from strata_operator.reports.fold import fold_report

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
