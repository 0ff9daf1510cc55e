"""Folding sidecar reports into ``CheckpointPolicy.status.jobs[]`` (pure: no I/O).

:func:`fold_report` takes the current ``status.jobs`` and one :class:`strata.reports.SidecarReport`
and returns the new list plus the Events the report warrants (:class:`EventSpec`). The report
receiver (:mod:`strata_operator.reports.receiver`) folds the reports of one status interval with it
into one status patch (:mod:`strata_operator.reports.coalescer`); the unit tests call it directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from strata.reports import SidecarReport
from strata_operator import api
from strata_operator.api import conditions as c
from strata_operator.api.events import EventSpec
from strata_operator.constants import (
    EVENT_FRESH_START,
    EVENT_RESTORE_FAILED,
    EVENT_RESTORED,
    EVENT_TIER_FAILED,
    EVENT_TIER_TOO_SMALL,
)

_fmt = c.format_time


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

    entry_job = api.JobStatus.model_validate(
        {
            "jobId": report.job_id,
            "newestCompleteStep": steps,
            **({"lastRestore": last_restore} if last_restore else {}),
            **({"lastError": last_error} if last_error else {}),
            **({"tooSmall": too_small} if too_small else {}),
            "updateTime": _fmt(now),
        }
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    others = [dict(j) for j in jobs if j.get("jobId") != report.job_id]
    return [entry_job, *others][:max_jobs], events
