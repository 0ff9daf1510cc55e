"""Restore planning (pure): newest step restorable on every rank, never a mix (C-07)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.restore import RankInventory, plan_restore, restorable_steps, skipped_partial_steps

pytestmark = pytest.mark.unit


class Inv:
    """Builder: Inv(rank, world).ram(95, 100).pvc({95: [0, 1]}).obj()"""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.committed: dict[str, dict[int, frozenset[int]]] = {}
        self.partial: dict[str, dict[int, frozenset[int]]] = {}

    def ram(self, *steps: int) -> Inv:
        self.committed.setdefault("ram", {}).update({s: frozenset({self.rank}) for s in steps})
        return self

    def shared(self, tier: str, steps: dict[int, list[int]]) -> Inv:
        self.committed.setdefault(tier, {}).update({s: frozenset(r) for s, r in steps.items()})
        return self

    def partial_in(self, tier: str, step: int, ranks: list[int]) -> Inv:
        self.partial.setdefault(tier, {})[step] = frozenset(ranks)
        return self

    def obj(self) -> RankInventory:
        return RankInventory(self.rank, self.world, self.committed, self.partial)


def test_c07_ranks_never_mix_steps() -> None:
    """C-07: rank A's RAM holds 95 and 100, rank B's only 95, no other tier holds 100 -> 95."""
    invs = [Inv(0, 2).ram(95, 100).obj(), Inv(1, 2).ram(95).obj()]
    plan = plan_restore(invs, 2)
    assert plan is not None and plan.step == 95
    assert plan.sources == {0: ("ram",), 1: ("ram",)}


def test_shared_tier_completes_a_step() -> None:
    invs = [
        Inv(0, 2).ram(95, 100).shared("pvc", {100: [1]}).obj(),
        Inv(1, 2).ram(95).shared("pvc", {100: [1]}).obj(),
    ]
    plan = plan_restore(invs, 2)
    assert plan is not None and plan.step == 100
    assert plan.sources == {0: ("ram",), 1: ("pvc",)}


def test_another_ranks_ram_does_not_serve_me() -> None:
    """A node-local tier only serves the rank that reported it (rank 1 was rescheduled)."""
    inv0 = RankInventory(0, 2, {"ram": {100: frozenset({0, 1})}})
    inv1 = RankInventory(1, 2, {"ram": {}})
    assert plan_restore([inv0, inv1], 2) is None


def test_tier_order_nearest_first_and_custom_order() -> None:
    invs = [Inv(0, 1).ram(10).shared("pvc", {10: [0]}).shared("gcs", {10: [0]}).obj()]
    plan = plan_restore(invs, 1)
    assert plan is not None and plan.sources == {0: ("ram", "pvc", "gcs")}
    plan = plan_restore(invs, 1, order=("gcs", "pvc", "ram"))
    assert plan is not None and plan.sources == {0: ("gcs", "pvc", "ram")}


def test_exclude_replans_to_older_step() -> None:
    invs = [Inv(0, 1).ram(10, 20).shared("pvc", {5: [0]}).obj()]
    assert [
        p.step
        for p in [
            plan_restore(invs, 1),
            plan_restore(invs, 1, exclude=[20]),
            plan_restore(invs, 1, exclude=[20, 10]),
        ]
        if p
    ] == [20, 10, 5]
    assert plan_restore(invs, 1, exclude=[20, 10, 5]) is None


def test_nothing_restorable() -> None:
    assert plan_restore([Inv(0, 1).obj()], 1) is None


def test_world_size_disagreement_is_an_error() -> None:
    with pytest.raises(ValueError, match="world size"):
        plan_restore([Inv(0, 2).obj(), Inv(1, 3).obj()], 2)


def test_c03_partial_steps_are_reported() -> None:
    invs = [Inv(0, 1).ram(5).partial_in("ram", 6, [0]).partial_in("pvc", 6, [0]).obj()]
    plan = plan_restore(invs, 1)
    assert plan is not None and plan.step == 5
    notes = skipped_partial_steps(invs)
    assert any("ram: step 6 has data without a manifest" in n for n in notes)
    assert any("pvc: step 6" in n for n in notes)


def test_inventory_roundtrips_through_plain_dicts() -> None:
    inv = Inv(1, 2).ram(3).shared("gcs", {4: [0, 1]}).partial_in("pvc", 9, [1]).obj()
    assert RankInventory.from_dict(inv.to_dict()) == inv


@given(
    world=st.integers(1, 4),
    holdings=st.lists(
        st.tuples(st.sampled_from(["ram", "pvc", "gcs"]), st.integers(0, 5), st.integers(0, 3)),
        max_size=30,
    ),
)
@settings(max_examples=200, deadline=None)
def test_plan_is_newest_step_every_rank_can_read(
    world: int, holdings: list[tuple[str, int, int]]
) -> None:
    committed: list[dict[str, dict[int, set[int]]]] = [{} for _ in range(world)]
    for tier, step, rank in holdings:
        if rank >= world:
            continue
        # RAM shards are reported by their own rank; shared tiers by (some) rank 0
        reporter = rank if tier == "ram" else 0
        committed[reporter].setdefault(tier, {}).setdefault(step, set()).add(rank)
    invs = [
        RankInventory(
            r, world, {t: {s: frozenset(x) for s, x in steps.items()} for t, steps in c.items()}
        )
        for r, c in enumerate(committed)
    ]

    def readable(step: int, rank: int) -> bool:
        return any(
            (
                t == "ram"
                and step in committed[rank].get("ram", {})
                and rank in committed[rank]["ram"][step]
            )
            or (t != "ram" and any(rank in c.get(t, {}).get(step, set()) for c in committed))
            for t in ("ram", "pvc", "gcs")
        )

    expected = [s for s in range(5, -1, -1) if all(readable(s, r) for r in range(world))]
    plan = plan_restore(invs, world)
    assert (plan.step if plan else None) == (expected[0] if expected else None)
    assert restorable_steps(invs, world) == expected
    # every rank, planning from the same gathered inventories, picks the same step
    assert all(plan_restore(list(reversed(invs)), world) == plan for _ in range(2))
