"""Which tiers can serve a resharding restore (issue 29 item 2), on a real RAM directory, a real
PVC directory and fake-gcs-server: steps of other world sizes, picked by commit records (shared
tiers) and by every rank's checksummed shard of one incarnation (a node's RAM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.restore.reshard import pick_reshard, reshard_sources
from strata.tiers.base import Tier
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import commit_if_complete
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import write_ram_shard

pytestmark = pytest.mark.integration
JOB = "ns.src"


def ram_step(ram: RamTier, step: int, world: int, incs: list[str], verified: bool = True) -> None:
    """Every rank's shard of ``step`` in this node's RAM (rank r of incarnation ``incs[r]``)."""
    for r in range(world):
        m = write_ram_shard(
            ram, JOB, step, r, bytes([r + 1]) * 3000, world_size=world, verified=verified
        )
        ram.write_manifest(JOB, step, r, m.model_copy(update={"incarnation": incs[r]}))


def promoted(ram: RamTier, tier: Tier, step: int, world: int, inc: str, commit: bool) -> None:
    ram_step(ram, step, world, [inc] * world)
    for r in range(world):
        m = ram.get_manifest(JOB, step, r)
        path = ram.data_path(JOB, step, r)
        assert path is not None
        tier.put_shard(JOB, step, r, path, m)
    if commit:
        assert commit_if_complete(tier, JOB, step, "test") is not None


@pytest.fixture(params=["pvc", "gcs"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "pvc":
        return PosixTier(tmp_path / "pvc")
    emu: GcsEmulator = request.getfixturevalue("gcs_emulator")
    bucket: str = request.getfixturevalue("gcs_bucket")
    return GcsTier(emu.tier_config(bucket, prefix="p"), client=emu.client())


def test_a_shared_tier_is_a_source_of_the_steps_it_committed_at_other_world_sizes(
    shm_dir: Path, shared: Tier
) -> None:
    scratch = RamTier(shm_dir / "scratch", keep=8)
    promoted(scratch, shared, 10, 4, "i1", commit=True)
    promoted(scratch, shared, 11, 4, "i1", commit=False)  # every shard, no commit record
    promoted(scratch, shared, 12, 2, "i1", commit=True)  # this job's world size
    got = reshard_sources([shared], JOB, 0, 2)
    assert got["sources"] == [
        {"step": 10, "world_size": 4, "incarnation": "i1", "tier": shared.name}
    ]
    assert reshard_sources([shared], JOB, 1, 2, shared=False)["sources"] == []
    choice = pick_reshard([got], 2, ("ram", shared.name))
    assert choice is not None and choice.step == 10 and choice.sources[1] == (shared.name,)


def test_a_nodes_ram_is_a_source_only_when_it_holds_every_checksummed_shard_of_one_incarnation(
    shm_dir: Path,
) -> None:
    ram = RamTier(shm_dir / "node", keep=8)
    ram_step(ram, 20, 2, ["i1", "i1"])  # both ranks of one pod: a source
    ram_step(ram, 21, 2, ["i1", "i1"], verified=False)  # no checksums yet: never read
    ram_step(ram, 22, 2, ["i1", "i2"])  # shards of two incarnations: never one step
    write_ram_shard(ram, JOB, 23, 0, b"x" * 3000, world_size=2)  # rank 1's shard is elsewhere
    got = reshard_sources([ram], JOB, 0, 1, shared=False)
    assert got["sources"] == [{"step": 20, "world_size": 2, "incarnation": "i1", "tier": "ram"}]
    # the same node at world size 2 has nothing to reshard
    assert reshard_sources([ram], JOB, 0, 2)["sources"] == []
