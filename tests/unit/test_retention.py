"""Retention planning: which steps of a tier the promotion engine deletes, and which it never does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.sidecar.promotion import plan_retention
from strata.sidecar.promotion.policies import LatestN
from strata.tiers.base import StepListing

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
GRACE = 600.0


def complete(step: int, world: int = 2, mtime: float = NOW - 10_000) -> StepListing:
    return StepListing(step, frozenset(range(world)), frozenset(), world, mtime)


def partial(
    step: int,
    committed: set[int],
    data: set[int],
    world: int | None = 2,
    mtime: float | None = NOW - 10_000,
) -> StepListing:
    return StepListing(
        step, frozenset(committed), frozenset(data), world if committed else None, mtime
    )


def by_step(*listings: StepListing) -> dict[int, StepListing]:
    return {li.step: li for li in listings}


def test_keeps_the_newest_n_complete_steps() -> None:
    plan = plan_retention(
        by_step(complete(100), complete(200), complete(300)),
        LatestN(2),
        now=NOW,
        grace_seconds=GRACE,
    )
    assert plan.prune == (100,)
    assert plan.gc == ()


def test_c02_a_half_written_newer_step_never_causes_the_committed_one_to_be_pruned() -> None:
    # keep=1; step 200 is being written (rank 0 committed, rank 1 data only): 100 stays.
    plan = plan_retention(
        by_step(complete(100), partial(200, {0}, {1}, mtime=NOW)),
        LatestN(1),
        now=NOW,
        grace_seconds=GRACE,
    )
    assert plan == plan.__class__()


def test_nothing_is_deleted_while_no_step_is_complete() -> None:
    plan = plan_retention(
        by_step(partial(100, {0}, {1}), partial(200, set(), {0, 1})),
        LatestN(1),
        now=NOW,
        grace_seconds=0,
    )
    assert plan.prune == () and plan.gc == ()


def test_incomplete_steps_older_than_the_newest_complete_are_collected_after_the_grace() -> None:
    listings = by_step(
        partial(50, set(), {0}, mtime=NOW - GRACE - 1),  # old leftovers: collected
        partial(150, {0}, {1}, mtime=NOW - 5),  # recent: waits for its grace period
        complete(200),
        partial(250, set(), {0, 1}, mtime=NOW - 99_999),  # newer than the newest complete: never
    )
    plan = plan_retention(listings, LatestN(3), now=NOW, grace_seconds=GRACE)
    assert plan.gc == (50,)
    assert plan.waiting == (150,)
    assert plan.prune == ()


def test_a_listing_without_mtime_counts_from_when_it_was_first_seen() -> None:
    listings = by_step(partial(50, set(), {0}, mtime=None), complete(100))
    fresh = plan_retention(
        listings, LatestN(1), now=NOW, grace_seconds=GRACE, first_seen={50: NOW - 1}
    )
    old = plan_retention(
        listings, LatestN(1), now=NOW, grace_seconds=GRACE, first_seen={50: NOW - GRACE - 1}
    )
    assert fresh.gc == () and fresh.waiting == (50,)
    assert old.gc == (50,)


@given(
    steps=st.dictionaries(
        st.integers(0, 50),
        st.tuples(st.booleans(), st.floats(0, 2 * GRACE)),
        max_size=12,
    ),
    keep=st.integers(1, 4),
)
def test_invariants_hold_for_any_tier_state(
    steps: dict[int, tuple[bool, float]], keep: int
) -> None:
    listings = by_step(
        *(
            complete(s, mtime=NOW - age) if is_complete else partial(s, {0}, {1}, mtime=NOW - age)
            for s, (is_complete, age) in steps.items()
        )
    )
    plan = plan_retention(listings, LatestN(keep), now=NOW, grace_seconds=GRACE)
    completes = sorted(s for s, (c, _) in steps.items() if c)
    deleted = set(plan.prune) | set(plan.gc)
    if completes:
        newest = completes[-1]
        # The newest complete step and the newest `keep` complete steps survive.
        assert newest not in deleted
        assert set(completes[-keep:]).isdisjoint(deleted)
        # Nothing at or above the newest complete step is touched (in-flight saves).
        assert all(s < newest for s in deleted)
    else:
        assert not deleted
    # Retention prunes only complete steps; GC only incomplete ones.
    assert all(steps[s][0] for s in plan.prune)
    assert not any(steps[s][0] for s in plan.gc)
