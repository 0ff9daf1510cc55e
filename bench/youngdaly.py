"""Young/Daly arithmetic: the checkpoint interval and goodput a checkpoint cost allows.

With checkpoint cost ``C`` (seconds training is stalled per checkpoint), mean time between
failures ``M`` (of the whole job) and restart cost ``R`` (reschedule + restore), the first-order
optimal interval is Young's ``tau = sqrt(2 C M)`` (J. W. Young, "A first order approximation to
the optimum checkpoint interval", CACM 1974; Daly 2006 adds higher-order terms that matter only
when C approaches M). The fraction of wall time spent on useful work is then approximately

    goodput = 1 - C / tau - (tau / 2 + R) / M

(each interval pays C; each failure loses on average half an interval plus the restart).
"""

from __future__ import annotations

import math

HOUR = 3600.0


def optimal_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 C M) in seconds; C and M in seconds, C > 0."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def goodput(
    cost_s: float, mtbf_s: float, restart_s: float = 0.0, interval_s: float | None = None
) -> float:
    """Fraction of useful work (0..1) at ``interval_s`` (default: Young's optimum)."""
    tau = optimal_interval(cost_s, mtbf_s) if interval_s is None else interval_s
    return max(0.0, 1.0 - cost_s / tau - (tau / 2.0 + restart_s) / mtbf_s)


def table(
    costs: dict[str, float],
    mtbf_hours: tuple[float, ...] = (1.0, 4.0, 24.0),
    restart_s: float = 0.0,
) -> list[dict[str, float | str]]:
    """One row per (method, MTBF): cost, optimal interval and goodput."""
    rows: list[dict[str, float | str]] = []
    for method, cost in costs.items():
        if not (cost > 0 and math.isfinite(cost)):
            continue
        for h in mtbf_hours:
            m = h * HOUR
            tau = optimal_interval(cost, m)
            rows.append(
                {
                    "method": method,
                    "cost_s": cost,
                    "mtbf_h": h,
                    "interval_s": tau,
                    "goodput": goodput(cost, m, restart_s, tau),
                    "lost_fraction": 1.0 - goodput(cost, m, restart_s, tau),
                }
            )
    return rows
