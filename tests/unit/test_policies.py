"""Interval and retention policies: when a tier is due, which complete steps it keeps."""

from __future__ import annotations

import pytest

from strata.config import Interval, StrataConfig
from strata.errors import PolicyError
from strata.sidecar.promotion.policies import (
    AnyOf,
    EveryNSeconds,
    EveryNSteps,
    EveryStep,
    LatestN,
    interval_policy,
    tier_policies,
)

pytestmark = pytest.mark.unit


def promoted_steps(policy: EveryNSteps | EveryStep | AnyOf, seen: list[int]) -> list[int]:
    """Feed the steps the sidecar sees, in order; return the ones promoted (no clock involved)."""
    last: int | None = None
    out = []
    for step in seen:
        if policy.due(step, last, now=0.0, last_time=0.0):
            out.append(step)
            last = step
    return out


def test_every_n_steps_is_aligned_to_multiples() -> None:
    assert promoted_steps(EveryNSteps(50), list(range(10, 310, 10))) == [
        50,
        100,
        150,
        200,
        250,
        300,
    ]


def test_every_n_steps_promotes_the_next_step_when_the_multiple_was_missed() -> None:
    # The RAM tier moved from 40 to 60 before the sidecar looked: 60 is promoted, then 100 again.
    assert promoted_steps(EveryNSteps(50), [40, 60, 70, 90, 110, 150]) == [60, 110, 150]


def test_every_n_steps_never_promotes_an_older_or_equal_step() -> None:
    policy = EveryNSteps(10)
    assert not policy.due(100, 100, 0.0, None)
    assert not policy.due(90, 100, 0.0, None)


def test_every_n_seconds_counts_from_the_last_promotion() -> None:
    policy = EveryNSeconds(30)
    assert policy.due(5, None, now=100.0, last_time=None)
    assert not policy.due(6, 5, now=129.0, last_time=100.0)
    assert policy.due(6, 5, now=130.0, last_time=100.0)
    assert not policy.due(5, 5, now=1000.0, last_time=100.0)


def test_interval_with_steps_and_seconds_is_due_when_either_elapsed() -> None:
    policy = interval_policy(Interval(steps=100, seconds=60))
    assert isinstance(policy, AnyOf)
    assert policy.due(100, 0, now=1.0, last_time=0.0)  # steps bound
    assert policy.due(10, 0, now=61.0, last_time=0.0)  # seconds bound
    assert not policy.due(10, 0, now=30.0, last_time=0.0)


def test_interval_without_bounds_is_every_step() -> None:
    policy = interval_policy(Interval())
    assert isinstance(policy, EveryStep)
    assert promoted_steps(policy, [1, 2, 2, 3]) == [1, 2, 3]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: EveryNSteps(0), "every.steps"),
        (lambda: EveryNSteps(True), "every.steps"),
        (lambda: EveryNSeconds(0), "every.seconds"),
        (lambda: EveryNSeconds(float("inf")), "every.seconds"),
        (lambda: LatestN(0), "newest complete step is never deleted"),
        (lambda: LatestN(-2), "keep"),
        (lambda: AnyOf(()), "at least one"),
        (lambda: AnyOf((EveryStep(), EveryNSteps(5))), "EveryStep is always due"),
    ],
)
def test_invalid_or_conflicting_options_are_refused_with_a_message_naming_them(make, words) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PolicyError, match=words):
        make()


def test_latest_n_keeps_the_newest_n() -> None:
    assert LatestN(2).to_delete([300, 100, 200, 400]) == [100, 200]
    assert LatestN(5).to_delete([1, 2]) == []
    assert LatestN(1).to_delete([7]) == []


def test_tier_policies_refuse_a_durable_interval_the_ram_tier_cannot_feed() -> None:
    config = StrataConfig.parse(
        {"job_id": "ns.job", "ram": {"every": {"steps": 10}}, "pvc": {"every": {"steps": 15}}}
    )
    with pytest.raises(
        PolicyError, match=r"pvc\.every\.steps=15 is not a multiple of ram\.every\.steps=10"
    ):
        tier_policies(config)


def test_tier_policies_of_the_demo_configuration() -> None:
    config = StrataConfig.parse(
        {
            "job_id": "ns.job",
            "ram": {"every": {"steps": 10}},
            "pvc": {"every": {"steps": 50}, "keep": 2},
            "gcs": {"bucket": "bkt", "every": {"steps": 100}, "keep": 3},
        }
    )
    policies = tier_policies(config)
    assert set(policies) == {"ram", "pvc", "gcs"}
    assert promoted_steps(policies["gcs"].interval, list(range(10, 310, 10))) == [100, 200, 300]  # type: ignore[arg-type]
    assert policies["pvc"].retention.to_delete([50, 100, 150]) == [50]


def test_the_interval_picks_the_step_to_promote() -> None:
    """Step intervals pick the newest multiple (pods at different steps fill the same durable
    step); intervals with a time bound pick the newest step."""
    ram = [70, 80, 90, 100, 110]
    assert EveryNSteps(20).candidate(ram) == 100
    assert EveryNSteps(200).candidate(ram) is None
    assert EveryNSeconds(5).candidate(ram) == 110
    assert EveryStep().candidate(ram) == 110
    assert AnyOf((EveryNSteps(20), EveryNSeconds(5))).candidate(ram) == 110
    assert EveryNSteps(20).candidate([]) is None


def test_the_trainer_saves_the_multiples_of_the_step_bound_and_when_the_seconds_elapsed() -> None:
    """The trainer's rule is the sidecar's policy asked with the step before as the last one
    seen (strata.intervals.due_now): step 0 and every multiple of ``steps``; a seconds bound
    from the last save."""
    from strata.intervals import due_now

    steps = interval_policy(Interval(steps=10))
    assert [s for s in range(35) if due_now(steps, s, 0.0, None)] == [0, 10, 20, 30]
    seconds = interval_policy(Interval(seconds=5.0))
    assert due_now(seconds, 7, now=100.0, last_time=None)
    assert not due_now(seconds, 7, now=104.0, last_time=100.0)
    assert due_now(seconds, 7, now=105.0, last_time=100.0)
    both = interval_policy(Interval(steps=10, seconds=5.0))
    assert due_now(both, 20, now=101.0, last_time=100.0)
    assert due_now(both, 21, now=105.0, last_time=100.0)
    assert not due_now(both, 21, now=101.0, last_time=100.0)
    assert all(due_now(interval_policy(Interval()), s, 0.0, 0.0) for s in range(5))
