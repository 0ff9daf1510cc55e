"""Global commit records on a real PVC directory and fake-gcs-server: conditional create,
idempotence, torn records, un-commit before deletion (issue 12)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from strata.errors import CommitError
from strata.format import layout
from strata.format.commit import StepCommit, build_commit
from strata.format.incarnation import Incarnation, Lineage, new_incarnation_id
from strata.tiers.base import Tier
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import (
    commit_if_complete,
    read_commit,
    read_manifest_raw,
    verify_commit,
    write_commit,
)
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import write_ram_shard

pytestmark = pytest.mark.integration
JOB = "ns.rec"


def fill(ram: RamTier, tier: Tier, step: int, world: int, inc: str, ranks: list[int]) -> None:
    for r in ranks:
        m = write_ram_shard(ram, JOB, step, r, bytes([r + 1]) * 5000, world_size=world)
        m = m.model_copy(update={"incarnation": inc})
        tier.put_shard(JOB, step, r, ram.data_path(JOB, step, r), m)


def chained_records(n: int, base_of: Callable[[int], int]) -> list[Incarnation]:
    """``n`` incarnation records that carry their chain, as restores write them: the first a
    fresh start, record ``i`` resuming step ``base_of(i)`` of record ``i - 1``."""
    t0 = datetime(2026, 12, 4, tzinfo=UTC)
    recs: list[Incarnation] = []
    for i in range(n):
        at = t0 + timedelta(seconds=i)
        parent, base = (recs[-1].id, base_of(i)) if recs else (None, None)
        recs.append(
            Incarnation(
                job_id=JOB,
                id=new_incarnation_id(at),
                parent=parent,
                base_step=base,
                world_size=1,
                created=at,
                ancestors=Lineage(recs).ancestry(parent, base),
            )
        )
    return recs


@pytest.fixture(params=["pvc", "gcs"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "pvc":
        return PosixTier(tmp_path / "pvc")
    emu: GcsEmulator = request.getfixturevalue("gcs_emulator")
    bucket: str = request.getfixturevalue("gcs_bucket")
    return GcsTier(emu.tier_config(bucket, prefix="p"), client=emu.client())


def test_commit_written_once_when_complete_idempotent_and_racing(shm_dir: Path, tier: Tier) -> None:
    ram = RamTier(shm_dir, keep=2)
    fill(ram, tier, 10, 2, "inc-a", [0])
    assert commit_if_complete(tier, JOB, 10, "w0") is None  # rank 1 missing
    assert read_commit(tier, JOB, 10) is None
    fill(ram, tier, 10, 2, "inc-a", [1])
    results: list[StepCommit | None] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(commit_if_complete(tier, JOB, 10, f"w{i}"))
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = read_commit(tier, JOB, 10)
    assert stored is not None and stored.incarnation == "inc-a" and stored.world_size == 2
    assert all(r is not None and r.same_commit(stored) for r in results)
    assert verify_commit(tier, stored) == []
    assert tier.list_steps(JOB)[10].has_commit


def test_shards_of_two_incarnations_are_never_committed(shm_dir: Path, tier: Tier) -> None:
    ram = RamTier(shm_dir, keep=2)
    fill(ram, tier, 20, 2, "inc-a", [0])
    fill(ram, tier, 20, 2, "inc-b", [1])
    assert commit_if_complete(tier, JOB, 20, "w") is None
    assert read_commit(tier, JOB, 20) is None


def test_torn_record_is_replaced_and_a_different_one_refused(shm_dir: Path, tier: Tier) -> None:
    ram = RamTier(shm_dir, keep=2)
    fill(ram, tier, 30, 1, "inc-a", [0])
    key = layout.commit_key(JOB, 30)
    good = build_commit(JOB, 30, {0: read_manifest_raw(tier, JOB, 30, 0)}, "w")
    assert tier.create_record(key, good.to_bytes()[:50])  # a writer died mid-record
    assert write_commit(tier, good).same_commit(good)
    assert read_commit(tier, JOB, 30) is not None
    other = good.model_copy(update={"incarnation": "inc-z"})
    with pytest.raises(CommitError, match="already commits other shards"):
        write_commit(tier, other)


def test_deleting_a_rank_uncommits_the_step_first(shm_dir: Path, tier: Tier) -> None:
    ram = RamTier(shm_dir, keep=2)
    fill(ram, tier, 40, 2, "inc-a", [0, 1])
    assert commit_if_complete(tier, JOB, 40, "w") is not None
    tier.delete_step(JOB, 40, frozenset({1}))
    assert read_commit(tier, JOB, 40) is None
    assert not tier.list_steps(JOB)[40].has_commit


def test_a_node_behind_the_job_never_promotes_over_a_newer_incarnation(
    shm_dir: Path, tmp_path: Path
) -> None:
    """This node's RAM still holds incarnation X (its trainer has not restored yet) while the
    PVC already names a newer incarnation Y: the sidecar promotes nothing and removes nothing
    there; once Y's record reaches this node's RAM it promotes Y's step."""
    from strata.config import StrataConfig
    from strata.format.incarnation import Incarnation
    from strata.sidecar.promotion import PromotionEngine
    from strata.tiers.records import write_incarnation

    cfg = StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(shm_dir), "keep": 2},
            "pvc": {"path": str(tmp_path / "pvc"), "every": {"steps": 10}, "keep": 2},
            "writer_id": "node-a",
        }
    )
    ram, pvc = RamTier(shm_dir, keep=2), PosixTier(tmp_path / "pvc")
    x = Incarnation(job_id=JOB, id="20260101T000000000000Z-aaaaaaaa", world_size=1)
    y = Incarnation(
        job_id=JOB, id="20260102T000000000000Z-bbbbbbbb", parent=x.id, base_step=10, world_size=1
    )
    write_incarnation(ram, x)
    write_incarnation(pvc, x)
    write_incarnation(pvc, y)
    m = write_ram_shard(ram, JOB, 20, 0, b"x" * 4000)
    ram.write_manifest(JOB, 20, 0, m.model_copy(update={"incarnation": x.id}))
    engine = PromotionEngine(cfg, ram, {"pvc": pvc})
    engine.promote_once()
    assert 20 not in pvc.list_steps(JOB)
    write_incarnation(ram, y)  # this node's trainer restored: Y is current here too
    m = write_ram_shard(ram, JOB, 30, 0, b"y" * 4000)
    ram.write_manifest(JOB, 30, 0, m.model_copy(update={"incarnation": y.id}))
    engine.promote_once()
    c = read_commit(pvc, JOB, 30)
    assert c is not None and c.incarnation == y.id


def test_a_step_of_another_world_size_is_noted_as_reshard_only_not_unsupported(
    tmp_path: Path,
) -> None:
    """A committed step of world size 2 seen by a 1-rank job: the note points at resharding
    (which restores it), never at "resharding is not supported"."""
    from strata.restore.inventory import collect_inventory

    ram, pvc = RamTier(tmp_path / "ram"), PosixTier(tmp_path / "pvc")
    fill(ram, pvc, 30, 2, "i1", [0, 1])
    assert commit_if_complete(pvc, JOB, 30, "w") is not None
    fill(ram, pvc, 31, 2, "i1", [0])  # no commit record: this rank's shard alone
    inv = collect_inventory([pvc], JOB, 0, 1)
    assert not inv.committed["pvc"]
    assert len(inv.notes) == 2, inv.notes
    for note in inv.notes:
        assert "not supported" not in note
        assert "only a resharding restore can load it" in note
        assert "reshard=False" in note  # resharding is the default: the note names the opt-out


class _RacedPosix(PosixTier):
    """A PVC tier whose ``delete_step`` is joined, once, by another sidecar's commit of the same
    step right after the record was removed and before the manifests go (the interleaving
    forced at the delete's first directory sync)."""

    race: tuple[str, int] | None = None

    def _sync_dir(self, d: Path) -> None:
        super()._sync_dir(d)
        if self.race is not None:
            job, step = self.race
            self.race = None
            assert commit_if_complete(self, job, step, "other-sidecar") is not None


def test_a_commit_racing_retention_leaves_no_stale_record(shm_dir: Path, tmp_path: Path) -> None:
    from strata.tiers.records import committed_steps

    ram, tier = RamTier(shm_dir, keep=2), _RacedPosix(tmp_path / "pvc")
    fill(ram, tier, 50, 2, "inc-a", [0, 1])  # complete, its record not written yet
    tier.race = (JOB, 50)
    tier.delete_step(JOB, 50)
    assert tier.race is None  # the racing commit did land mid-delete
    assert read_commit(tier, JOB, 50) is None
    assert 50 not in tier.step_numbers(JOB)
    assert committed_steps(tier, JOB) == {}


def test_a_stale_record_does_not_count_and_a_replay_commits(shm_dir: Path, tier: Tier) -> None:
    """A record that outlived its shards (the racing commit landed after the delete removed it
    a second time: forced here by putting it back) is not a committed step, and the step's
    replay by a new incarnation commits over it."""
    from strata.tiers.records import committed_steps

    ram = RamTier(shm_dir, keep=2)
    fill(ram, tier, 60, 2, "inc-a", [0, 1])
    old = commit_if_complete(tier, JOB, 60, "w")
    assert old is not None
    tier.delete_step(JOB, 60)
    assert tier.create_record(layout.commit_key(JOB, 60), old.to_bytes())
    assert 60 not in committed_steps(tier, JOB)
    fill(ram, tier, 60, 2, "inc-b", [0, 1])
    new = commit_if_complete(tier, JOB, 60, "w")
    assert new is not None and new.incarnation == "inc-b"
    found = read_commit(tier, JOB, 60)
    assert found is not None and found.same_commit(new)
    assert committed_steps(tier, JOB)[60].incarnation == "inc-b"
    assert verify_commit(tier, found) == []


def test_incarnation_records_are_read_once_per_tier_and_a_commit_recreates_none_there(
    shm_dir: Path, tier: Tier
) -> None:
    """A job gains an incarnation record at every restore. Each inventory reads them and each
    commit copies the chain next to it: both cost one listing plus the records the tier (object)
    has not seen, not one request per record (before: a chaos run's 600 restores made every
    restore read 600 records from GCS and every GCS commit re-create 600, and restores went from
    0.13 s to 2.6 s)."""
    from datetime import UTC, datetime, timedelta

    from strata.format.incarnation import Incarnation, new_incarnation_id
    from strata.tiers.records import read_incarnations, write_missing_incarnations

    calls = {"read": 0, "create": 0}

    class Counting(type(tier)):  # type: ignore[misc]
        def read_record(self, key: str) -> bytes | None:
            calls["read"] += "/incarnations/" in key
            payload: bytes | None = super().read_record(key)
            return payload

        def create_record(self, key: str, payload: bytes) -> bool:
            calls["create"] += "/incarnations/" in key
            created: bool = super().create_record(key, payload)
            return created

    tier.__class__ = Counting
    t0 = datetime(2026, 12, 4, tzinfo=UTC)
    chain: list[Incarnation] = []
    for i in range(40):
        at = t0 + timedelta(seconds=i)
        chain.insert(
            0,
            Incarnation(
                job_id=JOB,
                id=new_incarnation_id(at),
                parent=chain[0].id if chain else None,
                base_step=i if chain else None,
                world_size=1,
                created=at,
            ),
        )
    assert write_missing_incarnations(tier, JOB, chain) == 40 and calls["create"] == 40
    ram = RamTier(shm_dir, keep=2)
    fill(ram, tier, 50, 1, chain[0].id, [0])
    assert commit_if_complete(tier, JOB, 50, "w", chain[0].id, records=chain) is not None
    assert calls["create"] == 40  # every record of the chain was listed there: none re-created
    ids = {r.id for r in chain}
    assert {r.id for r in read_incarnations(tier, JOB)} == ids and calls["read"] == 40
    assert {r.id for r in read_incarnations(tier, JOB)} == ids and calls["read"] == 40
    late = Incarnation(
        job_id=JOB,
        id=new_incarnation_id(t0 + timedelta(hours=1)),
        parent=chain[0].id,
        base_step=50,
        world_size=1,
        created=t0 + timedelta(hours=1),
    )
    assert write_missing_incarnations(tier, JOB, [late, *chain]) == 1
    assert {r.id for r in read_incarnations(tier, JOB)} == ids | {late.id}
    assert calls["read"] == 41  # the new one only
    gone = chain[-1]
    tier.delete_record(layout.incarnation_key(JOB, gone.id))
    assert {r.id for r in read_incarnations(tier, JOB)} == (ids | {late.id}) - {gone.id}


def test_a_commit_collects_the_incarnation_records_the_newest_one_makes_redundant(
    shm_dir: Path, tier: Tier
) -> None:
    """Records that carry their chain: a commit leaves the newest ``KEEP_INCARNATION_RECORDS``
    in the tier and deletes the rest, and the tier alone still tells every step's liveness as
    all 40 records did (before: every restore's record stayed for good, and a 600-restore run
    read 600 per restore)."""

    from strata.format.incarnation import Lineage
    from strata.tiers.records import (
        KEEP_INCARNATION_RECORDS,
        lineage,
        read_incarnations,
        write_missing_incarnations,
    )

    # each restore resumes step 10*i-5 of the one before (which saved 10*i-9 .. 10*i-1)
    recs = chained_records(40, lambda i: 10 * i - 5)
    everything = Lineage(recs)
    assert write_missing_incarnations(tier, JOB, recs) == 40
    ram = RamTier(shm_dir, keep=2)
    newest = recs[-1]
    fill(ram, tier, 400, 1, newest.id, [0])
    assert commit_if_complete(tier, JOB, 400, "w", newest.id, records=[newest]) is not None
    left = {r.id for r in read_incarnations(tier, JOB)}
    assert left == {r.id for r in recs[-KEEP_INCARNATION_RECORDS:]}
    alone = lineage([tier], JOB)
    assert alone.current == newest.id
    for i, r in enumerate(recs):
        for step in range(10 * i - 9, 10 * i):
            assert alone.live(r.id, step) == everything.live(r.id, step), (i, step)
    assert alone.live(recs[0].id, 5) and not alone.live(recs[0].id, 6)  # a deep ancestor
    fill(ram, tier, 401, 1, newest.id, [0])
    assert commit_if_complete(tier, JOB, 401, "w", newest.id, records=[newest]) is not None
    assert {r.id for r in read_incarnations(tier, JOB)} == left


def test_the_sidecar_collects_the_redundant_incarnation_records_of_the_nodes_ram(
    shm_dir: Path,
) -> None:
    """Every rank writes its restore's record into the node's RAM tier; the sidecar's view of
    the node keeps the newest ``KEEP_INCARNATION_RECORDS`` once the newest carries its chain,
    and the chain it copies next to a commit is that one record."""

    from strata.sidecar.promotion.world import RamWorld
    from strata.tiers.records import KEEP_INCARNATION_RECORDS, read_incarnations, write_incarnation

    ram = RamTier(shm_dir, keep=2)
    recs = chained_records(30, lambda i: i)
    for rec in recs:
        write_incarnation(ram, rec)
    world = RamWorld(ram, JOB).snapshot({}, [0])
    assert world.incarnation == recs[-1].id
    kept = {r.id for r in recs[-KEEP_INCARNATION_RECORDS:]}
    assert {r.id for r in read_incarnations(ram, JOB)} == kept
    assert {r.id for r in world.records} == kept
    assert world.chain() == [recs[-1]]
