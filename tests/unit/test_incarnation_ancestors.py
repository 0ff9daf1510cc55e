"""Incarnation records that carry their chain (``ancestors``): the lineage from the newest few
records is the lineage from all of them, whatever the history of restores."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from strata.format.incarnation import Incarnation, Lineage, sufficient
from strata.tiers.records import KEEP_INCARNATION_RECORDS

T0 = datetime(2026, 12, 4, tzinfo=UTC)


def _history(
    seed: int, restores: int
) -> tuple[list[Incarnation], list[Incarnation], set[tuple[str, int]]]:
    """A random job history: each incarnation saves 0-3 steps, each restore resumes from a random
    live step (or fresh-starts, rarely), as the restore picks it from the lineage it reads.

    Returns (records without ancestors, records with ancestors as the restorer writes them when
    each restore saw only the newest ``KEEP_INCARNATION_RECORDS`` records, saved (inc, step))."""
    rng = random.Random(seed)
    old: list[Incarnation] = []
    new: list[Incarnation] = []
    saved: set[tuple[str, int]] = {("", s) for s in range(rng.randint(0, 2))}
    step = len(saved)
    for i in range(restores):
        kept = sorted(new, key=lambda r: (r.created, r.id))[-KEEP_INCARNATION_RECORDS:]
        seen = Lineage(kept)
        live = sorted((s, inc) for inc, s in saved if seen.live(inc, s))
        if live and rng.random() > 0.03:
            # mostly the newest live step; sometimes an older one (a corrupt newest copy)
            base_step, parent = live[-1] if rng.random() < 0.7 else rng.choice(live)
            ancestors = seen.ancestry(parent or None, base_step)
        else:
            base_step, parent, ancestors = None, "", {}
        inc = f"{i:06d}"
        fields = dict(
            job_id="j",
            id=inc,
            parent=parent or None,
            base_step=base_step,
            world_size=1,
            created=T0 + timedelta(seconds=i),
        )
        old.append(Incarnation(**fields))
        new.append(Incarnation(**fields, ancestors=ancestors))
        # the new incarnation replays from base_step + 1 (the step numbers of a superseded run
        # come back with other bytes) and crashes after 0-3 saves
        step = (base_step if base_step is not None else -1) + 1
        for _ in range(rng.randint(0, 3)):
            saved.add((inc, step))
            step += 1
    return old, new, saved


@pytest.mark.parametrize("seed", range(40))
def test_the_newest_records_alone_give_the_lineage_of_every_record(seed: int) -> None:
    """Which saved steps are live, by the chain walked through every record (as before), is the
    same as by the newest ``KEEP_INCARNATION_RECORDS`` records with ancestors, and as by the
    newest one alone; so collecting the others changes no restore, promotion or retention."""
    old, new, saved = _history(seed, restores=120)
    full = Lineage(old)
    kept = Lineage(sorted(new, key=lambda r: (r.created, r.id))[-KEEP_INCARNATION_RECORDS:])
    newest = Lineage(new[-1:])
    for inc, step in sorted(saved):
        want = full.live(inc, step)
        assert kept.live(inc, step) == want, (inc, step, want)
        assert newest.live(inc, step) == want, (inc, step, want)
    assert any(full.live(i, s) for i, s in saved) or new[-1].base_step is None


def test_ancestry_of_a_parent_whose_record_was_collected_comes_from_the_chain() -> None:
    """A crash loop resumes the same step of an incarnation many times: that incarnation's own
    record drops out of the newest few, and the next restore still copies its chain (before the
    chain came from the parent's record: the grandparent's steps would have gone dead)."""

    def rec(
        i: int, parent: str | None, base: int | None, anc: dict[str, int] | None
    ) -> Incarnation:
        return Incarnation(
            job_id="j",
            id=f"{i:03d}",
            parent=parent,
            base_step=base,
            world_size=1,
            created=T0 + timedelta(seconds=i),
            ancestors=anc,
        )

    a = rec(0, None, None, {})
    b = rec(1, "000", 5, {"000": 5})  # b resumed step 5 of a, then saved 6..9
    loop = [rec(2 + k, "001", 9, {"001": 9, "000": 5}) for k in range(20)]  # all crash at once
    lin = Lineage(loop)  # b's and a's records are gone
    assert lin.ancestry("001", 9) == {"001": 9, "000": 5}
    assert lin.ancestry("001", 7) == {"001": 7, "000": 5}
    assert Lineage([a, b]).ancestry("001", 9) == {"001": 9, "000": 5}
    assert lin.ancestry(None, 3) == {"": 3}
    assert lin.ancestry(None, None) == {}


def test_an_ancestor_id_that_is_not_an_incarnation_id_is_refused() -> None:
    with pytest.raises(ValueError, match="ancestor id"):
        Incarnation(job_id="j", id="a", world_size=1, ancestors={"../x": 1})


@pytest.mark.parametrize("seed", range(10))
def test_a_rank_ships_one_record_per_tier_and_the_lineage_stays_that_of_all(seed: int) -> None:
    """What a restore inventory carries (:func:`sufficient`): the newest record alone once it
    carries its chain (before: every record the tier kept, each with its chain: 1.1 MB per
    rank in a 1,800-restore chaos run), and every record of the older kind it needs otherwise;
    the lineage is that of all records either way."""
    old, new, saved = _history(seed, restores=60)
    assert sufficient(new) == [new[-1]]
    for recs in (old, new, old[:30] + new[30:]):
        full, few = Lineage(recs), Lineage(sufficient(recs))
        assert few.current == full.current
        assert all(few.live(i, s) == full.live(i, s) for i, s in saved)
