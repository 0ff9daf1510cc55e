"""Promotion, commit and retention at a cost per sidecar independent of the world size: no
sidecar lists the whole job's shards; one designated writer commits each step (others take over
after a timeout); retention still deletes every rank of old steps (GC complete). Real tiers: a
PVC directory and fake-gcs-server; several real engines, one per simulated node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strata.config import StrataConfig, TierName
from strata.format import layout
from strata.sidecar.promotion.committer import commit_writer_rank
from strata.sidecar.promotion.round import PromotionEngine
from strata.tiers.base import StepListing, Tier
from strata.tiers.gcs.tier import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import read_commit
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import write_ram_shard

pytestmark = pytest.mark.integration

JOB = "ns.train"
RANKS_PER_NODE = 2
NODES = 3
WORLD = RANKS_PER_NODE * NODES


class CountingPosix(PosixTier):
    """A real PVC tier that counts whole-job listings (the O(world size) call)."""

    full_listings = 0

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        CountingPosix.full_listings += 1
        return super().list_steps(job_id)


class CountingGcs(GcsTier):
    full_listings = 0

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        CountingGcs.full_listings += 1
        return super().list_steps(job_id)


def node_config(ram: Path, node: int, tier: TierName, extra: dict[str, Any]) -> StrataConfig:
    return StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(ram), "every": {"steps": 10}, "keep": 1},
            "writer_id": f"node-{node}",
            "gc_grace_seconds": 0,
            tier: {**extra, "every": {"steps": 10}, "keep": 2},
        }
    )


def node_ranks(node: int) -> list[int]:
    return list(range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE))


def save(ram: RamTier, node: int, step: int) -> None:
    for r in node_ranks(node):
        write_ram_shard(
            ram, JOB, step, r, f"s{step}r{r}".encode() * 100, world_size=WORLD,
            writer_id=f"node-{node}/rank-{r}",
        )  # fmt: skip


def make_nodes(
    shm_dir: Path, tier: TierName, extra: dict[str, Any], make_tier: Any, clock: Any = None
) -> list[tuple[RamTier, PromotionEngine]]:
    out = []
    for n in range(NODES):
        d = shm_dir / f"node-{n}"
        d.mkdir()
        ram = RamTier(d, keep=1)
        kw = {"clock": clock} if clock is not None else {}
        engine = PromotionEngine(
            node_config(d, n, tier, extra),
            ram,
            {tier: make_tier(n)},
            local_ranks=node_ranks(n),
            maintenance_seconds=0,
            **kw,
        )
        out.append((ram, engine))
    return out


def run_steps(nodes: list[tuple[RamTier, PromotionEngine]], steps: list[int]) -> None:
    for step in steps:
        for n, (ram, _e) in enumerate(nodes):
            save(ram, n, step)
        for _round in range(3):  # the designated writer may come after the last placer
            for _ram, e in nodes:
                e.promote_once()


def check_scoped_and_complete(reader: Tier, full_listings: int) -> None:
    assert full_listings == 0, "a sidecar listed every shard of the job"
    # Retention kept the newest two committed steps, and GC left nothing of the older ones.
    assert reader.step_numbers(JOB) == [50, 60]
    for step in (50, 60):
        c = read_commit(reader, JOB, step)
        assert c is not None and c.world_size == WORLD
        listing = reader.list_step(JOB, step)
        assert listing is not None and listing.committed_ranks == frozenset(range(WORLD))
    for step in (10, 20, 30, 40):
        assert reader.list_step(JOB, step) is None
        assert reader.read_record(layout.commit_key(JOB, step)) is None


def test_posix_commit_and_retention_never_list_the_job_and_gc_stays_complete(
    shm_dir: Path, tmp_path: Path
) -> None:
    CountingPosix.full_listings = 0
    root = tmp_path / "pvc"
    nodes = make_nodes(shm_dir, "pvc", {"path": str(root)}, lambda _n: CountingPosix(root))
    run_steps(nodes, [10, 20, 30, 40, 50, 60])
    check_scoped_and_complete(PosixTier(root), CountingPosix.full_listings)
    # Old step directories are gone, not merely emptied.
    assert sorted(p.name for p in (root / layout.steps_prefix(JOB)).iterdir()) == [
        layout.step_name(50),
        layout.step_name(60),
    ]


def test_gcs_commit_and_retention_never_list_the_job_and_gc_stays_complete(
    shm_dir: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    CountingGcs.full_listings = 0
    cfg = gcs_emulator.tier_config(gcs_bucket)
    extra = {"bucket": gcs_bucket, "endpoint": gcs_emulator.endpoint}
    nodes = make_nodes(
        shm_dir,
        "gcs",
        extra,
        lambda n: CountingGcs(cfg, writer_id=f"node-{n}", client=gcs_emulator.client()),
    )
    run_steps(nodes, [10, 20, 30, 40, 50, 60])
    reader = GcsTier(cfg, writer_id="reader", client=gcs_emulator.client())
    check_scoped_and_complete(reader, CountingGcs.full_listings)
    names = [b.name for b in gcs_emulator.client().list_blobs(gcs_bucket)]
    assert not [n for n in names if "/steps/00000000001" in n or "/steps/00000000002" in n]
    assert not [n for n in names if "/steps/00000000003" in n or "/steps/00000000004" in n]


def test_a_dead_designated_writer_is_taken_over_after_the_timeout(
    shm_dir: Path, tmp_path: Path
) -> None:
    step = 10
    root = tmp_path / "pvc"
    now = [0.0]
    dead = commit_writer_rank(step, WORLD) // RANKS_PER_NODE
    nodes = make_nodes(
        shm_dir, "pvc", {"path": str(root)}, lambda _n: PosixTier(root), clock=lambda: now[0]
    )
    pvc = PosixTier(root)
    # The designated writer's sidecar placed its shards, then died before committing.
    ram, _engine = nodes[dead]
    save(ram, dead, step)
    for r in node_ranks(dead):
        pvc.put_shard(JOB, step, r, ram.data_path(JOB, step, r), ram.get_manifest(JOB, step, r))
    live = [(n, rig) for n, rig in enumerate(nodes) if n != dead]
    for n, (ram, _e) in live:
        save(ram, n, step)
    for _round in range(3):
        for _n, (_ram, e) in live:
            e.promote_once()
    assert pvc.list_step(JOB, step).complete  # type: ignore[union-attr]
    assert read_commit(pvc, JOB, step) is None  # nobody else commits before the timeout
    now[0] += nodes[0][1].commits.takeover_seconds + 1
    for _n, (_ram, e) in live:
        e.promote_once()
    c = read_commit(pvc, JOB, step)
    assert c is not None and c.world_size == WORLD
    assert all(e.last_promoted() == {"pvc": step} for _n, (_r, e) in live)
