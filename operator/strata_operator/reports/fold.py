"""Folding sidecar reports into ``CheckpointPolicy.status.jobs[]`` (pure: no I/O).

:func:`fold_report` takes the current ``status.jobs`` and one :class:`strata.reports.SidecarReport`
and returns the new list plus the Events the report warrants (:class:`EventSpec`). The report
receiver (:mod:`strata_operator.reports.receiver`) folds the reports of one status interval with it
into one status patch (:mod:`strata_operator.reports.coalescer`); the unit tests call it directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from strata.reports import FlushEstimate, SidecarReport
from strata_operator import api
from strata_operator.api import conditions as c
from strata_operator.api.events import EventSpec
from strata_operator.constants import (
    EVENT_FLUSH_MISSED,
    EVENT_FLUSH_TOO_SLOW,
    EVENT_FRESH_START,
    EVENT_RESTORE_FAILED,
    EVENT_RESTORED,
    EVENT_TIER_FAILED,
    EVENT_TIER_TOO_SMALL,
    FLUSH_FITS,
    REASON_FLUSH_FITS,
    REASON_FLUSH_MISSED,
    REASON_FLUSH_TOO_SLOW,
)

_fmt = c.format_time

FLUSH_STALE_SECONDS = 300.0
"""A job's stored flush figures from a pod that has not reported them for this long (a deleted
or replaced pod) give way to any other pod's."""


def _whole(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(microsecond=0)


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def fold_report(
    jobs: Sequence[Mapping[str, Any]],
    report: SidecarReport,
    *,
    now: datetime,
    max_jobs: int = api.MAX_JOBS,
) -> tuple[list[dict[str, Any]], list[EventSpec]]:
    """Fold ``report`` into a ``status.jobs`` list (camelCase JSON); returns (jobs, events).

    The job's entry moves to the front (newest first); the list keeps ``max_jobs`` entries,
    dropping the least recently updated. Per tier, the reported ``newest_complete_step`` replaces
    the stored one (a tier the report does not mention keeps its value: the RAM of a recreated
    pod is empty, so the newest report is the truth, not the maximum). The last restore and last
    error are replaced only by newer ones (by their own time); only those produce events. A
    tier the report says is too small for ``keep + 1`` steps is set in ``tooSmall`` (an Event
    when it becomes so) and removed when a report of that tier no longer says so.
    """
    old = next((dict(j) for j in jobs if j.get("jobId") == report.job_id), None) or {}
    steps: dict[str, int] = dict(old.get("newestCompleteStep") or {})
    for tier, state in report.tiers.items():
        if state.newest_complete_step is not None:
            steps[tier] = state.newest_complete_step
    events: list[EventSpec] = []
    where = f"job {report.job_id} (pod {report.pod_name})"
    source = f"{report.job_id}|{report.pod_uid or report.pod_name}"

    last_restore = old.get("lastRestore")
    old_restore_time = _parse_time((last_restore or {}).get("time"))
    for restore in sorted(report.restores, key=lambda r: r.time):
        # Stored times have whole seconds (metav1.Time style). Several ranks restore within the
        # same second, so only strictly older restores are skipped; repeats are filtered by key.
        if old_restore_time is not None and _whole(restore.time) < old_restore_time:
            continue
        entry: dict[str, Any] = {"outcome": restore.outcome, "time": _fmt(restore.time)}
        if restore.tier is not None:
            entry["tier"] = restore.tier
        if restore.step is not None:
            entry["step"] = restore.step
        entry["seconds"] = round(restore.seconds, 3)
        last_restore = entry
        old_restore_time = _whole(restore.time)
        rank = "" if restore.rank is None else f" rank {restore.rank}"
        key = f"{source}|restore|{restore.rank}|{restore.time.isoformat()}"
        skipped = f"; skipped: {', '.join(restore.skipped)}" if restore.skipped else ""
        if restore.outcome == "restored":
            events.append(
                EventSpec(
                    "Normal",
                    EVENT_RESTORED,
                    f"{where}{rank} restored step {restore.step} from tier {restore.tier} in "
                    f"{restore.seconds:.2f} s ({restore.bytes} bytes){skipped}",
                    key,
                )
            )
        elif restore.outcome == "fresh-start":
            events.append(
                EventSpec(
                    "Warning",
                    EVENT_FRESH_START,
                    f"{where}{rank} found no restorable step and started from scratch "
                    f"(restore.allowFreshStart){skipped}",
                    key,
                )
            )
        else:
            events.append(
                EventSpec(
                    "Warning",
                    EVENT_RESTORE_FAILED,
                    f"{where}{rank} could not restore any step{skipped}",
                    key,
                )
            )

    last_error = old.get("lastError")
    old_error_time = _parse_time((last_error or {}).get("time"))
    for error in sorted(report.errors, key=lambda e: e.time):
        if old_error_time is not None and _whole(error.time) < old_error_time:
            continue
        last_error = {"message": error.message[:2048], "time": _fmt(error.time)}
        if error.tier is not None:
            last_error["tier"] = error.tier
        old_error_time = _whole(error.time)
        part = f"tier {error.tier}" if error.tier else "sidecar"
        events.append(
            EventSpec(
                "Warning",
                EVENT_TIER_FAILED,
                f"{where}: {part} failed: {error.message}",
                f"{source}|error|{error.tier}|{error.time.isoformat()}",
            )
        )

    too_small: dict[str, str] = dict(old.get("tooSmall") or {})
    for tier, state in report.tiers.items():
        if state.too_small is None:
            too_small.pop(tier, None)
            continue
        if tier not in too_small:
            events.append(
                EventSpec(
                    "Warning",
                    EVENT_TIER_TOO_SMALL,
                    f"{where}: tier {tier} cannot hold keep + 1 steps, promotion to it stopped "
                    f"advancing: {state.too_small}",
                    f"{source}|too-small|{tier}|{state.too_small}",
                )
            )
        too_small[tier] = state.too_small[:1024]

    flush = old.get("flush")
    if report.flush is not None:
        flush, flush_events = _fold_flush(flush, report, report.flush, where, source)
        events += flush_events

    entry_job = api.JobStatus.model_validate(
        {
            "jobId": report.job_id,
            "newestCompleteStep": steps,
            **({"lastRestore": last_restore} if last_restore else {}),
            **({"lastError": last_error} if last_error else {}),
            **({"tooSmall": too_small} if too_small else {}),
            **({"flush": flush} if flush else {}),
            "updateTime": _fmt(now),
        }
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    others = [dict(j) for j in jobs if j.get("jobId") != report.job_id]
    return [entry_job, *others][:max_jobs], events


def _need(flush: Mapping[str, Any]) -> float:
    """How much of its budget a flush needs (a ratio; -1 when not measured)."""
    needed = flush.get("secondsNeeded")
    if needed is None:
        return -1.0
    budget = float(flush.get("budgetSeconds") or 0.0)
    return math.inf if budget <= 0 else float(needed) / budget


def _fold_flush(
    old: Mapping[str, Any] | None,
    report: SidecarReport,
    est: FlushEstimate,
    where: str,
    source: str,
) -> tuple[Mapping[str, Any] | None, list[EventSpec]]:
    """The job's ``flush`` after ``est`` (the pod whose flush needs the largest share of its
    budget wins; a missed flush always shows), and its Warning Events."""
    if est.seconds_needed is None and est.last_fit is None:
        return old, []  # nothing measured yet: the stored figures stay
    new: dict[str, Any] = api.FlushStatus(
        pod=report.pod_name,
        tier=est.tier,
        state_bytes=est.state_bytes,
        bytes_per_second=est.bytes_per_second,
        seconds_needed=None if est.seconds_needed is None else round(est.seconds_needed, 3),
        grace_seconds=est.grace_seconds,
        budget_seconds=est.budget_seconds,
        fits=est.fits,
        last_fit=est.last_fit,
        last_step=est.last_step,
        last_seconds=None if est.last_seconds is None else round(est.last_seconds, 3),
        time=report.time,
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    new["time"] = _fmt(report.time)
    if old:
        same_pod = old.get("pod") == report.pod_name
        old_time = _parse_time(old.get("time"))
        stale = old_time is None or report.time - old_time > timedelta(seconds=FLUSH_STALE_SECONDS)
        missed = est.last_fit is False
        if not (same_pod or stale or missed or _need(new) >= _need(old)):
            return old, []
    events: list[EventSpec] = []
    before = old if old and old.get("pod") == report.pod_name else {}
    if est.fits is False and before.get("fits") is not False and est.seconds_needed is not None:
        margin = est.grace_seconds - est.budget_seconds
        at_least = math.ceil(est.seconds_needed + margin)
        rate = est.bytes_per_second or 0.0
        events.append(
            EventSpec(
                "Warning",
                EVENT_FLUSH_TOO_SLOW,
                f"{where}: a termination flush of {(est.state_bytes or 0) / 2**20:.0f} MiB to tier "
                f"{est.tier} needs {est.seconds_needed:.1f} s at {rate / 1e6:.1f} MB/s, but the "
                f"pod's grace period of {est.grace_seconds:.0f} s leaves {est.budget_seconds:.0f} "
                "s: the steps since the last durable one are lost when the pod is preempted; set "
                f"spec.sidecar.terminationGracePeriodSeconds to at least {at_least} or make tier "
                f"{est.tier} faster",
                f"{source}|flush-too-slow",
            )
        )
    if est.last_fit is False and not (
        before.get("lastFit") is False and before.get("lastStep") == est.last_step
    ):
        seconds = "" if est.last_seconds is None else f" after {est.last_seconds:.1f} s"
        events.append(
            EventSpec(
                "Warning",
                EVENT_FLUSH_MISSED,
                f"{where}: the termination flush of step {est.last_step} to tier {est.tier} did "
                f"not finish within the grace period ({est.budget_seconds:.0f} s budget){seconds}; "
                "the replacement restores an older step",
                f"{source}|flush-missed|{est.last_step}",
            )
        )
    return new, events


def flush_condition(jobs: Sequence[Mapping[str, Any]]) -> c.NewCondition | None:
    """``FlushFitsGracePeriod`` from the jobs' ``flush`` entries; None while none was measured.

    False (``FlushTooSlow``) when a job's measured flush needs more than its budget, else False
    (``FlushMissedDeadline``) when a pod's last termination flush missed its deadline, else True
    (``FlushFits``) naming the job that needs the largest share of its budget."""
    flushes = [(j.get("jobId"), j["flush"]) for j in jobs if j.get("flush")]
    slow = [(job, f) for job, f in flushes if f.get("fits") is False]
    if slow:
        job, f = max(slow, key=lambda jf: _need(jf[1]))
        return c.NewCondition(
            FLUSH_FITS,
            "False",
            REASON_FLUSH_TOO_SLOW,
            f"job {job} (pod {f.get('pod')}): a termination flush of {f.get('stateBytes')} bytes "
            f"to tier {f.get('tier')} needs {f.get('secondsNeeded')} s; the pods' grace period "
            f"of {f.get('graceSeconds')} s leaves {f.get('budgetSeconds')} s. Raise "
            "spec.sidecar.terminationGracePeriodSeconds (or the pods' own) or make the tier "
            f"faster ({len(slow)} of {len(flushes)} measured jobs do not fit)",
        )
    missed = [(job, f) for job, f in flushes if f.get("lastFit") is False]
    if missed:
        job, f = missed[0]
        return c.NewCondition(
            FLUSH_FITS,
            "False",
            REASON_FLUSH_MISSED,
            f"job {job} (pod {f.get('pod')}): the termination flush of step {f.get('lastStep')} "
            f"to tier {f.get('tier')} missed its {f.get('budgetSeconds')} s budget "
            f"({f.get('lastSeconds')} s); raise the grace period or make the tier faster",
        )
    fitting = [(job, f) for job, f in flushes if f.get("fits") is True]
    if not fitting:
        return None
    job, f = max(fitting, key=lambda jf: _need(jf[1]))
    return c.NewCondition(
        FLUSH_FITS,
        "True",
        REASON_FLUSH_FITS,
        f"the slowest measured termination flush (job {job}, pod {f.get('pod')}: "
        f"{f.get('stateBytes')} bytes to tier {f.get('tier')}) needs {f.get('secondsNeeded')} s "
        f"of a {f.get('budgetSeconds')} s budget ({len(fitting)} jobs measured)",
    )


def with_flush_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    jobs: Sequence[Mapping[str, Any]],
    *,
    now: datetime | None = None,
) -> list[dict[str, Any]] | None:
    """``conditions`` with :func:`flush_condition` of ``jobs`` set; None when that changes
    nothing (no flush measured, or the same condition is already there)."""
    new = flush_condition(jobs)
    if new is None:
        return None
    old = [dict(cond) for cond in conditions or ()]
    out = c.set_condition(old, new, generation=None, now=now)
    return None if out == old else out
