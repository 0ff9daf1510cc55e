"""The step rule's pure parts: which dead steps are superseded, which are collected, which are
back-filled (strata.tiers.eligible, strata.sidecar.promotion.collection / backfill)."""

from __future__ import annotations

from strata.format.commit import ShardRef, StepCommit
from strata.format.incarnation import Incarnation, Lineage
from strata.sidecar.promotion.backfill import backfill_steps
from strata.sidecar.promotion.collection import collectible_steps
from strata.sidecar.promotion.policies import LatestN
from strata.tiers.eligible import superseded

JOB = "ns.rule"
X = Incarnation(job_id=JOB, id="20260101T000000000000Z-aaaaaaaa", world_size=1)
Y = Incarnation(
    job_id=JOB, id="20260102T000000000000Z-bbbbbbbb", parent=X.id, base_step=10, world_size=1
)
Z = Incarnation(
    job_id=JOB, id="20260103T000000000000Z-cccccccc", parent=Y.id, base_step=25, world_size=1
)


def commit(step: int, inc: Incarnation, archive_only: bool = False) -> StepCommit:
    return StepCommit(
        job_id=JOB,
        step=step,
        incarnation=inc.id,
        world_size=1,
        writer_id="w",
        shards=[ShardRef(rank=0, data_nbytes=1, crc32c=1, manifest_crc32c=1)],
        archive_only=archive_only,
    )


def test_superseded_only_when_no_fuller_view_can_find_the_step_live() -> None:
    full = Lineage([X, Y])
    assert superseded(full, X.id, 20)  # above Y's resume point
    assert not superseded(full, X.id, 10)  # Y resumed from it: live
    assert not superseded(full, Y.id, 30)  # the current incarnation's
    # A view that has not seen Y yet: Y's steps are dead to it, never superseded.
    behind = Lineage([X])
    assert not behind.live(Y.id, 15)
    assert not superseded(behind, Y.id, 15)
    # A view that knows nothing judges nothing.
    assert not superseded(Lineage([]), X.id, 20)
    # Whatever a later record adds, a superseded step stays dead.
    assert not Lineage([X, Y, Z]).live(X.id, 20)


def test_collection_keeps_steps_above_the_newest_eligible_and_those_live_elsewhere() -> None:
    lin = Lineage([X, Y])
    dead = {20: commit(20, X), 30: commit(30, X), 40: commit(40, X)}
    assert collectible_steps(lin, dead, None) == []
    assert collectible_steps(lin, dead, 35) == [20, 30]
    assert collectible_steps(lin, dead, 35, eligible_elsewhere={30}) == [20]
    assert collectible_steps(lin, dead, 35, designated=lambda s: s != 20) == [30]
    behind = Lineage([X])  # has not seen Y: Y's dead-looking steps are never collected
    assert collectible_steps(behind, {15: commit(15, Y)}, 30) == []


def test_backfill_takes_live_ancestor_steps_retention_keeps_never_the_current_ones() -> None:
    source = {10: commit(10, X), 20: commit(20, X), 30: commit(30, X), 40: commit(40, Y)}
    assert backfill_steps(source, {10: commit(10, X)}, LatestN(1), Y.id) == [30]
    # Y's own 40 is already in the destination: X's steps would be pruned there at once.
    assert backfill_steps(source, {10: commit(10, X), 40: commit(40, Y)}, LatestN(1), Y.id) == []
    assert backfill_steps(source, {10: commit(10, X)}, LatestN(3), Y.id) == [30, 20]
    assert backfill_steps(source, {}, LatestN(2), Y.id) == [30, 20]
    assert backfill_steps(source, {20: commit(20, X)}, LatestN(2), Y.id) == [30]
    assert backfill_steps(source, {}, LatestN(2), None) == []
    archived = {30: commit(30, X, archive_only=True)}
    assert backfill_steps(archived, {}, LatestN(2), Y.id) == []
