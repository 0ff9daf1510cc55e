"""One step rule everywhere (strata.tiers.eligible): collection of superseded steps and back-fill
of live ancestor steps, with sidecars whose views of the incarnation records disagree.

Real tiers (a PVC directory, fake-gcs-server with the real client), real RAM tiers on tmpfs and
one real promotion engine per simulated node; nodes die by no longer running their engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strata.config import StrataConfig, TierName
from strata.format import layout
from strata.format.incarnation import Incarnation
from strata.restore import collect_inventory, plan_restore
from strata.sidecar.promotion.round import PromotionEngine
from strata.tiers.base import Tier
from strata.tiers.gcs.tier import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import committed_steps, read_commit, write_incarnation
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import write_ram_shard

pytestmark = pytest.mark.integration

JOB = "ns.lineage"
WORLD = 2
X = Incarnation(job_id=JOB, id="20260101T000000000000Z-aaaaaaaa", world_size=WORLD)
"""The first run: rank 0 on node a, rank 1 on node b."""


def successor(base_step: int) -> Incarnation:
    """The run that restored ``base_step`` of X on a replacement node c (both ranks)."""
    return Incarnation(
        job_id=JOB,
        id="20260102T000000000000Z-bbbbbbbb",
        parent=X.id,
        base_step=base_step,
        world_size=WORLD,
    )


def payload(step: int, rank: int, inc: str) -> bytes:
    return f"<{inc[-4:]}:{step}:{rank}>".encode() * 400


def save(ram: RamTier, step: int, ranks: list[int], inc: Incarnation, writer: str) -> None:
    """Commit ``ranks``' shards of ``step`` into ``ram`` as incarnation ``inc`` (as the client)."""
    for r in ranks:
        m = write_ram_shard(
            ram, JOB, step, r, payload(step, r, inc.id), world_size=WORLD,
            writer_id=f"{writer}/rank-{r}",
        )  # fmt: skip
        ram.write_manifest(JOB, step, r, m.model_copy(update={"incarnation": inc.id}))


def node(
    root: Path, name: str, ranks: list[int], tiers: dict[TierName, Tier], cfg: dict[str, Any]
) -> tuple[RamTier, PromotionEngine]:
    d = root / name
    d.mkdir()
    ram = RamTier(d, keep=1)
    raw = {
        "job_id": JOB,
        "ram": {"path": str(d), "every": {"steps": 5}, "keep": 1},
        "writer_id": name,
        "gc_grace_seconds": 0,
        **cfg,
    }
    engine = PromotionEngine(
        StrataConfig.parse(raw), ram, tiers, local_ranks=ranks, maintenance_seconds=0
    )
    return ram, engine


def rounds(engines: list[PromotionEngine], n: int = 3, **kw: Any) -> None:
    for _ in range(n):
        for e in engines:
            e.promote_once(**kw)


def make_tier(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, writer: str, keep: int
) -> tuple[Tier, dict[str, Any]]:
    """A real tier of ``kind`` for one node, and the configuration naming it."""
    every = {"every": {"steps": 5}, "keep": keep}
    if kind == "pvc":
        return PosixTier(tmp_path / "pvc"), {"pvc": {"path": str(tmp_path / "pvc"), **every}}
    emu: GcsEmulator = request.getfixturevalue("gcs_emulator")
    bucket: str = request.getfixturevalue("gcs_bucket")
    tier = GcsTier(emu.tier_config(bucket, prefix="p"), writer_id=writer, client=emu.client())
    return tier, {"gcs": {"bucket": bucket, "prefix": "p", "endpoint": emu.endpoint, **every}}


@pytest.mark.parametrize("kind", ["pvc", "gcs"])
def test_superseded_steps_are_collected_and_no_live_step_is_lost_when_views_disagree(
    kind: str, request: pytest.FixtureRequest, shm_dir: Path, tmp_path: Path
) -> None:
    """X committed steps 10, 20, 30; node a died and the job restored step 10 on node c (Y), so
    X's 20 and 30 are superseded. Node b's sidecar still runs with X only (its trainer has not
    restored, and at the end it cannot even see Y's record); node c's sees Y. Every live step
    stays (X's 10: Y resumed from it; Y's own), X's 20 and 30 are collected once Y committed a
    newer step there, whatever node b's sidecar does. Today's code keeps 20 and 30 for ever:
    their writers' pods are gone and retention only removes a writer's own superseded shards."""
    made = {n: make_tier(kind, request, tmp_path, n, 10) for n in ("node-a", "node-b", "node-c")}
    tiers = {n: t for n, (t, _c) in made.items()}
    cfg = {n: c for n, (_t, c) in made.items()}
    name: TierName = "pvc" if kind == "pvc" else "gcs"
    ram_a, a = node(shm_dir, "node-a", [0], {name: tiers["node-a"]}, cfg["node-a"])
    ram_b, b = node(shm_dir, "node-b", [1], {name: tiers["node-b"]}, cfg["node-b"])
    for ram in (ram_a, ram_b):
        write_incarnation(ram, X)
    for step in (10, 20, 30):
        save(ram_a, step, [0], X, "node-a")
        save(ram_b, step, [1], X, "node-b")
        rounds([a, b])
    reader = tiers["node-c"]
    assert {s: c.incarnation for s, c in committed_steps(reader, JOB).items()} == {
        10: X.id,
        20: X.id,
        30: X.id,
    }

    y = successor(10)
    ram_c, c = node(shm_dir, "node-c", [0, 1], {name: tiers["node-c"]}, cfg["node-c"])
    write_incarnation(ram_c, y)
    # Node c sees Y, the tier does not yet: the newest eligible step there is X's 10, so X's
    # 20 and 30 (above it: Y may still replay those step numbers) are not collected yet.
    rounds([c, b])
    assert reader.step_numbers(JOB) == [10, 20, 30]
    # Node b's trainer still runs X: its sidecar promotes X's step 40 (rank 1) before its view
    # of the tier shows Y (a superseded step that is never committed).
    save(ram_b, 40, [1], X, "node-b")
    for step in (15, 25):
        save(ram_c, step, [0, 1], y, "node-c")
        rounds([c, b])
    assert reader.step_numbers(JOB) == [10, 15, 25, 30, 40]  # 30, 40: above the newest (25)
    save(ram_c, 35, [0, 1], y, "node-c")
    rounds([c, b])
    assert reader.step_numbers(JOB) == [10, 15, 25, 35, 40]
    for step in (20, 30):
        assert reader.read_record(layout.commit_key(JOB, step)) is None
    live = committed_steps(reader, JOB)
    assert {s: cm.incarnation for s, cm in live.items()} == {
        10: X.id,
        15: y.id,
        25: y.id,
        35: y.id,
    }

    # Node b cannot see Y's record at all now (it lags the tier): by its view X is current and
    # Y's steps belong to an incarnation it does not know. It deletes none of them, nor X's 10.
    reader.delete_record(layout.incarnation_key(JOB, y.id))
    b.views.progress[name].initialised = False
    rounds([b], n=2)
    assert reader.step_numbers(JOB) == [10, 15, 25, 35, 40]
    write_incarnation(reader, y)
    # X's 40 goes once Y commits past it, though no commit record names it.
    save(ram_c, 45, [0, 1], y, "node-c")
    rounds([c, b])
    assert reader.step_numbers(JOB) == [10, 15, 25, 35, 45]
    # A restore from this tier alone (both ranks) picks Y's newest step.
    invs = [collect_inventory([reader], JOB, r, WORLD) for r in range(WORLD)]
    chosen = plan_restore(invs, WORLD)
    assert chosen is not None and (chosen.step, chosen.incarnation) == (45, y.id)


class CountingGcs(GcsTier):
    """A real GCS tier that counts shard uploads (to show nothing is uploaded twice)."""

    puts: list[tuple[int, int]] = []

    def put_shard(self, job_id: str, step: int, rank: int, *args: Any, **kw: Any) -> int:
        CountingGcs.puts.append((step, rank))
        return super().put_shard(job_id, step, rank, *args, **kw)


def test_a_live_ancestor_step_missing_on_gcs_is_back_filled_by_the_replacement_sidecar(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    """X reached GCS with step 10 only; steps 20 and 30 reached the PVC (committed) when both
    nodes died. The job restored step 30 (Y) on node c, whose RAM never held X's steps. Node c's
    sidecar copies 30 to GCS and commits it there (GCS keeps 1 step: 20 would be pruned at once,
    so it is not copied), and never uploads it again. Today's code leaves GCS without 30."""
    cfg = gcs_emulator.tier_config(gcs_bucket, prefix="p")
    pvc_root = tmp_path / "pvc"

    def tiers(writer: str, counting: bool = False) -> dict[TierName, Tier]:
        cls = CountingGcs if counting else GcsTier
        return {
            "pvc": PosixTier(pvc_root),
            "gcs": cls(cfg, writer_id=writer, client=gcs_emulator.client()),
        }

    def config() -> dict[str, Any]:
        return {
            "pvc": {"path": str(pvc_root), "every": {"steps": 10}, "keep": 3},
            "gcs": {
                "bucket": gcs_bucket,
                "prefix": "p",
                "endpoint": gcs_emulator.endpoint,
                "every": {"steps": 10},
                "keep": 1,
            },
        }

    ram_a, a = node(shm_dir, "node-a", [0], tiers("node-a"), config())
    ram_b, b = node(shm_dir, "node-b", [1], tiers("node-b"), config())
    for ram in (ram_a, ram_b):
        write_incarnation(ram, X)
    save(ram_a, 10, [0], X, "node-a")
    save(ram_b, 10, [1], X, "node-b")
    rounds([a, b])
    for step in (20, 30):  # the PVC only (GCS uploads of these never happened)
        save(ram_a, step, [0], X, "node-a")
        save(ram_b, step, [1], X, "node-b")
        rounds([a, b], force_tier="pvc")
    pvc = PosixTier(pvc_root)
    gcs = GcsTier(cfg, writer_id="reader", client=gcs_emulator.client())
    assert sorted(committed_steps(pvc, JOB)) == [10, 20, 30]
    assert sorted(committed_steps(gcs, JOB)) == [10]

    y = successor(30)
    ram_c, c = node(shm_dir, "node-c", [0, 1], tiers("node-c", counting=True), config())
    write_incarnation(ram_c, y)
    CountingGcs.puts = []
    rounds([c], n=3)
    on_gcs = committed_steps(gcs, JOB)
    assert sorted(on_gcs) == [30]  # back-filled; 10 then pruned by GCS retention (keep 1)
    assert on_gcs[30].incarnation == X.id and on_gcs[30].world_size == WORLD
    assert sorted(CountingGcs.puts) == [(30, 0), (30, 1)]  # 20 not copied: not kept on GCS
    for r in range(WORLD):
        gcs.verify_shard(JOB, 30, r)
    rounds([c], n=2)
    assert sorted(CountingGcs.puts) == [(30, 0), (30, 1)]  # never uploaded again
    # GCS alone restores it (the PVC lost): X's 30 is live, Y resumed from it.
    write_incarnation(gcs, y)
    invs = [collect_inventory([gcs], JOB, r, WORLD) for r in range(WORLD)]
    chosen = plan_restore(invs, WORLD)
    assert chosen is not None and (chosen.step, chosen.incarnation) == (30, X.id)
    assert read_commit(gcs, JOB, 30) is not None
