"""The goodput model's arithmetic on closed-form cases (bench/goodput.py), not its figures."""

from __future__ import annotations

import math

import pytest
from bench import youngdaly
from bench.goodput import Level, Scenario, goodput, intervals, mtbf_seconds

MIX = {"node_local": 0.25, "node_loss": 0.75}


def one_level(
    cost: float, restore: float = 0.0, latency: float = 0.0, floor: float = 0.0
) -> Scenario:
    lv = Level("disk", cost, latency, restore, floor)
    return Scenario("one", {"disk": lv}, dict.fromkeys(MIX, "disk"))


def test_one_level_serving_every_failure_is_young_daly() -> None:
    cost, mtbf, restart = 2.0, 10_000.0, 30.0
    g = goodput(one_level(cost), MIX, mtbf, restart)
    assert g["intervals_s"]["disk"] == pytest.approx(math.sqrt(2 * cost * mtbf))
    assert g["goodput"] == pytest.approx(youngdaly.goodput(cost, mtbf, restart))


def test_restore_and_latency_add_per_failure() -> None:
    mtbf, tau = 1000.0, 100.0
    g = goodput(one_level(1.0, restore=20.0, latency=5.0), MIX, mtbf, 10.0, taus={"disk": tau})
    # 1/100 per interval; each failure: 50 (half an interval) + 5 + 20 + 10
    assert g["checkpoint_loss"] == pytest.approx(0.01)
    assert g["failure_loss"] == pytest.approx(85.0 / 1000.0)
    assert g["goodput"] == pytest.approx(1 - 0.01 - 0.085)


def test_each_level_takes_youngs_interval_for_the_failures_it_serves() -> None:
    ram, disk = Level("ram", 0.5, 0.0, 0.0), Level("disk", 2.0, 0.0, 0.0)
    s = Scenario("two", {"ram": ram, "disk": disk}, {"node_local": "ram", "node_loss": "disk"})
    taus = intervals(s, MIX, 40_000.0)
    assert taus["ram"] == pytest.approx(math.sqrt(2 * 0.5 * 40_000 / 0.25))
    assert taus["disk"] == pytest.approx(math.sqrt(2 * 2.0 * 40_000 / 0.75))


def test_floor_and_base_bound_the_intervals() -> None:
    ram, disk = Level("ram", 0.5, 0.0, 0.0), Level("disk", 0.0, 0.0, 0.0, floor_s=30.0)
    s = Scenario("two", {"ram": ram, "disk": disk}, {"node_local": "ram", "node_loss": "disk"})
    taus = intervals(s, MIX, 40_000.0, base="ram")
    assert taus["disk"] == 30.0  # no cost: as often as the copy allows
    assert taus["ram"] == 30.0  # the copies come from RAM: RAM at least as often


def test_failure_rate_scales_with_accelerators() -> None:
    assert mtbf_seconds(16384) == pytest.approx(54 * 86400 / 419)
    assert mtbf_seconds(1024) == pytest.approx(16 * mtbf_seconds(16384))
