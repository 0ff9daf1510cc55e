"""RAM tier on the real tmpfs: slot ring, hard-linked commits, leases across processes, ENOSPC."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from strata.errors import ShardUnavailable, SlotsBusy, TierFull
from strata.format import crc
from strata.format.manifest import Manifest, StorageEntry
from strata.tiers.ram import RamTier
from strata.tiers.slots import (
    SLOT_ALIGN,
    LocalSlotProvider,
    ReuseFirstSlotProvider,
    SlotLease,
    SlotProvider,
    SlotWriteLock,
    slots_dir,
)
from tests.fixtures.leases import lease_holder

pytestmark = pytest.mark.integration
JOB = "ns.train"


def commit(tier: RamTier, provider: SlotProvider, step: int, payload: bytes, rank: int = 0) -> Path:
    """What the client does: lock a slot, write into it, commit; returns the slot path."""
    with SlotWriteLock.acquire(provider, JOB, rank, len(payload)) as slot:
        with open(slot, "r+b") as f:
            f.write(payload)
        chunks, whole = crc.chunk_crcs(payload, chunk_size=4096)
        m = Manifest(
            job_id=JOB,
            step=step,
            rank=rank,
            world_size=1,
            writer_id="t",
            tree=None,
            tensors=[],
            storages=[StorageEntry(offset=0, nbytes=len(payload))],
            data_nbytes=len(payload),
            chunk_size=4096,
            chunk_crc32c=chunks,
            crc32c=whole,
        )
        tier.commit_slot(JOB, step, rank, slot, m)
        return slot


def test_ring_is_preallocated_and_commits_are_hard_links(shm_dir: Path) -> None:
    tier = RamTier(shm_dir, keep=2)
    provider = LocalSlotProvider(tier, keep=2)
    slot = commit(tier, provider, 10, b"a" * 5000)
    slots = sorted(os.listdir(slots_dir(shm_dir, JOB, 0)))
    assert slots == ["slot-0", "slot-1", "slot-2"]  # keep + 1
    for s in slots:
        st = os.stat(slots_dir(shm_dir, JOB, 0) / s)
        assert st.st_size == SLOT_ALIGN
        assert st.st_blocks * 512 >= SLOT_ALIGN  # allocated, not sparse
    data = tier.data_path(JOB, 10, 0)
    assert os.stat(data).st_ino == os.stat(slot).st_ino
    m = tier.get_manifest(JOB, 10, 0)
    assert m.data_nbytes == 5000 < os.stat(data).st_size
    out = shm_dir / "out"
    tier.fetch_shard(JOB, 10, 0, out)
    assert out.read_bytes() == b"a" * 5000


def test_slots_are_reused_oldest_first_and_keep_is_honoured(shm_dir: Path) -> None:
    tier = RamTier(shm_dir, keep=1)
    provider = LocalSlotProvider(tier, keep=1)
    used = [commit(tier, provider, s, bytes([s]) * 3000) for s in range(1, 6)]
    assert len(set(used)) == 2  # a ring of two slots
    # the newest committed step always survives; one older step may remain until the next save
    steps = sorted(tier.list_steps(JOB))
    assert steps == [4, 5]
    for s in steps:
        tier.verify_file(tier.data_path(JOB, s, 0), tier.get_manifest(JOB, s, 0))


def test_c05_leased_slot_is_never_overwritten(shm_dir: Path) -> None:
    """C-05: a reader in another process holds step 2's slot; saves go elsewhere, never over it."""
    tier = RamTier(shm_dir, keep=1)
    provider = LocalSlotProvider(tier, keep=1, max_slots=3)
    commit(tier, provider, 1, b"\x01" * 3000)
    commit(tier, provider, 2, b"\x02" * 3000)
    with lease_holder(shm_dir, JOB, 1, 0):
        # step 1 (oldest, evictable) is leased: step 3 takes a new third slot instead
        commit(tier, provider, 3, b"\x03" * 3000)
        assert len(os.listdir(slots_dir(shm_dir, JOB, 0))) == 3
        commit(tier, provider, 4, b"\x04" * 3000)  # evicts step 2, not the leased step 1
        assert tier.data_path(JOB, 1, 0).read_bytes()[:3000] == b"\x01" * 3000
        tier.verify_file(tier.data_path(JOB, 1, 0), tier.get_manifest(JOB, 1, 0))
        commit(tier, provider, 5, b"\x05" * 3000)
        # Lease step 5's slot as well: step 6 reuses step 4's slot, then with every slot either
        # leased or holding the newest step, step 7 is refused (back-pressure), never torn.
        with pytest.raises(SlotsBusy, match="being read"), lease_holder(shm_dir, JOB, 5, 0):
            commit(tier, provider, 6, b"\x06" * 3000)
            commit(tier, provider, 7, b"\x07" * 3000)
        assert tier.data_path(JOB, 1, 0).read_bytes()[:3000] == b"\x01" * 3000
    commit(tier, provider, 8, b"\x08" * 3000)  # lease released: reuse works again
    assert 8 in tier.list_steps(JOB)


def test_lease_fails_cleanly_when_step_is_gone(shm_dir: Path) -> None:
    tier = RamTier(shm_dir)
    with pytest.raises(ShardUnavailable, match="not committed"), SlotLease(tier, JOB, 3, 0):
        pass


def test_slot_grows_when_state_outgrows_it(shm_dir: Path) -> None:
    tier = RamTier(shm_dir, keep=1)
    provider = LocalSlotProvider(tier, keep=1)
    commit(tier, provider, 1, b"s" * 1000)
    big = os.urandom(3 * SLOT_ALIGN + 5)
    slot = commit(tier, provider, 2, big)
    assert os.stat(slot).st_size == 4 * SLOT_ALIGN
    out = shm_dir / "out"
    tier.fetch_shard(JOB, 2, 0, out)
    assert out.read_bytes() == big
    assert tier.data_path(JOB, 1, 0).read_bytes()[:1000] == b"s" * 1000  # previous step intact


def test_stale_partial_link_is_reclaimed(shm_dir: Path) -> None:
    tier = RamTier(shm_dir, keep=1)
    provider = LocalSlotProvider(tier, keep=1)
    commit(tier, provider, 1, b"1" * 100)
    slot2 = commit(tier, provider, 2, b"2" * 100)
    tier.manifest_path(JOB, 2, 0).unlink()  # a writer killed between link and manifest
    assert tier.list_steps(JOB)[2].partial_ranks == {0}
    slot3 = commit(tier, provider, 3, b"3" * 100)
    assert slot3 == slot2  # the partial step's slot was reclaimed; committed step 1 kept
    assert sorted(tier.list_steps(JOB)) == [1, 3]


def test_enospc_on_slot_allocation(small_tmpfs: Callable[[int], Path]) -> None:
    root = small_tmpfs(3 * SLOT_ALIGN)
    tier = RamTier(root, keep=1)
    provider = LocalSlotProvider(tier, keep=1)
    commit(tier, provider, 1, b"x" * 1000)  # two 1 MiB slots fit
    with pytest.raises(TierFull, match=r"no space left on the RAM tier .*slot-"):
        commit(tier, provider, 2, b"y" * (2 * SLOT_ALIGN))  # growing a slot to 2 MiB does not
    assert tier.data_path(JOB, 1, 0).read_bytes()[:1000] == b"x" * 1000
    sizes = sorted(os.stat(p).st_size for p in slots_dir(root, JOB, 0).iterdir())
    assert sizes == [SLOT_ALIGN, SLOT_ALIGN]  # the failed growth was undone


class CountingAllocator:
    """The sidecar's role: allocates (and pre-faults) slots; counts how often it is asked."""

    def __init__(self, tier: RamTier, keep: int) -> None:
        self.provider = LocalSlotProvider(tier, keep=keep)
        self.calls = 0

    def acquire_slot(self, job_id: str, rank: int, nbytes: int, exclude: object = ()) -> Path:
        self.calls += 1
        return self.provider.acquire_slot(job_id, rank, nbytes)


def test_saves_reuse_free_slots_locally_and_ask_the_allocator_only_to_allocate(
    shm_dir: Path,
) -> None:
    tier = RamTier(shm_dir, keep=1)
    allocator = CountingAllocator(tier, keep=1)
    provider = ReuseFirstSlotProvider(LocalSlotProvider(tier, keep=1, allocate=False), allocator)
    commit(tier, provider, 10, b"a" * 5000)
    assert allocator.calls == 1  # the ring did not exist: the allocator built it
    for step in range(20, 101, 10):
        commit(tier, provider, step, bytes([step]) * 5000)
    assert allocator.calls == 1  # every later save reused a slot without a round trip
    assert tier.newest_complete_step(JOB) == 100
    # A state that outgrows the slots goes back to the allocator, which grows one.
    big = b"b" * (4 * 1024 * 1024)
    commit(tier, provider, 110, big)
    assert allocator.calls == 2
    with SlotLease(tier, JOB, 110, 0) as lease:
        assert lease.path.read_bytes()[: len(big)] == big
