"""Restore at bandwidth (issue 14): one pass that verifies a RAM shard while loading it in place."""

from __future__ import annotations

import copy
import mmap
import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer, RestoreError
from strata.client.loader import load_shard
from strata.errors import ShardCorrupt, StageError
from strata.format import crc
from strata.format.manifest import Manifest
from strata.restore.staging import (
    STAGING_PREFIX,
    first_slot,
    remove_stale_first_slots,
    stage_into_ram,
)
from strata.tiers.posix import PosixTier
from strata.tiers.posix_io import remove_quietly
from strata.tiers.ram import RamTier
from strata.tiers.slots import (
    LocalSlotProvider,
    identity_of,
    path_identity,
    slot_size_for,
    slots_dir,
)

pytestmark = pytest.mark.integration
JOB = "ns.load"


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3 * 1024 * 1024 // 4 + 17, generator=g)  # 3 MiB: crosses a chunk edge
    huge = torch.randn(9 * 1024 * 1024 // 4 + 5, generator=g)  # 9 MiB: three chunks
    base = torch.randn(64, 32, generator=g)
    model = torch.nn.Linear(32, 8)
    with torch.no_grad():
        model.weight.copy_(torch.randn(8, 32, generator=g))
    return {
        "big": big,
        "huge": huge,
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "ints": torch.randint(0, 1 << 30, (513,), generator=g, dtype=torch.int64),
        "base": base,
        "transposed": base.t(),  # a non-contiguous view of the same storage
        "row": base[3],  # a contiguous view at an offset
        "empty": torch.empty(0, 4),
        "model": model,
        "many": [torch.randn(37, generator=g) for _ in range(300)],
        "step": seed,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in ("big", "huge", "bf16", "ints", "base", "transposed", "row", "empty"):
        assert torch.equal(a[k], b[k]), k
    for x, y in zip(a["many"], b["many"], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a["model"].weight, b["model"].weight)
    assert torch.equal(a["model"].bias, b["model"].bias)


def _saved_shard(shm_dir: Path, state: dict[str, Any]) -> tuple[Manifest, Path]:
    """Save ``state`` as step 1 of rank 0 into the RAM tier at ``shm_dir`` (checksummed); its
    manifest and data file."""
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(1, state)
        c.wait()
        return c.ram.get_manifest(JOB, 1, 0), c.ram.data_path(JOB, 1, 0)


def test_one_pass_restores_every_byte_into_the_live_tensors(shm_dir: Path) -> None:
    saved = _state(1)
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, copy_threads=3) as c:
        assert c.save(5, saved)
        c.wait()
        live = _state(2)
        ids = {k: id(v) for k, v in live.items() if k != "step"}
        weight = live["model"].weight
        res = c.restore(live)
    assert res.step == 5 and res.tier == "ram"
    _same(live, saved)
    assert {k: id(v) for k, v in live.items() if k != "step"} == ids  # loaded in place
    assert live["step"] == 1
    assert live["model"].weight is weight
    # the views still share the live storage after the load
    assert live["transposed"].data_ptr() == live["base"].data_ptr()


def test_the_pass_computes_the_manifest_crcs_and_copies_by_bytes(shm_dir: Path) -> None:
    saved = _state(3)
    m, path = _saved_shard(shm_dir, saved)
    live = _state(4)
    with ThreadPoolExecutor(3) as pool:
        out = load_shard(live, m, path, pool=pool, workers=4, verify=True)
    _same(live, saved)
    assert out.chunk_crc32c == m.chunk_crc32c and out.crc32c == m.crc32c
    # everything but the transposed view (and the empty tensor) went through the one pass
    assert (
        out.fast_bytes
        == sum(
            t.numel() * t.element_size()
            for k, t in saved.items()
            if isinstance(t, torch.Tensor) and k != "transposed"
        )
        + sum(t.numel() * 4 for t in saved["many"])
        + (8 * 32 + 8) * 4
    )


def test_a_flipped_byte_is_named_and_refused(shm_dir: Path) -> None:
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(1, _state(5))
        c.wait()
        m = c.ram.get_manifest(JOB, 1, 0)
        path = c.ram.data_path(JOB, 1, 0)
    at = 4 * 1024 * 1024 + 123  # inside chunk 1
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(ShardCorrupt, match="chunk 1 "):
        load_shard(_state(6), m, path, pool=None, workers=1, verify=True)
    # without verification the pass still returns the CRCs of what it read
    out = load_shard(_state(6), m, path, pool=None, workers=1, verify=False)
    assert out.chunk_crc32c == crc.file_chunk_crcs(path, m.data_nbytes, m.chunk_size)[0]
    assert out.chunk_crc32c[1] != (m.chunk_crc32c or [])[1]


def test_a_corrupt_ram_copy_partly_loaded_refuses_a_fresh_start(shm_dir: Path) -> None:
    ram = shm_dir / "ram"
    with Checkpointer(job_id=JOB, ram_dir=ram, rank=0, world_size=1) as c:
        assert c.save(1, _state(7))
        c.wait()
        path = c.ram.data_path(JOB, 1, 0)
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xfe")
    with (
        Checkpointer(job_id=JOB, ram_dir=ram, rank=0, world_size=1, allow_fresh_start=True) as c,
        pytest.raises(RestoreError, match="partly loaded"),
    ):
        c.restore(_state(8))
    assert any(".quarantined-" in n for n in os.listdir(path.parent))


def test_a_shard_without_checksums_is_checksummed_by_the_load(shm_dir: Path) -> None:
    saved = _state(9)
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(2, saved)
        c.wait()
        m = c.ram.get_manifest(JOB, 2, 0)
        # as if the writer died before its checksum pass
        c.ram.write_manifest(JOB, 2, 0, m.model_copy(update={"chunk_crc32c": None, "crc32c": None}))
        live = _state(10)
        res = c.restore(live)
        assert any("had no checksums yet" in n for n in res.skipped)
        sealed = c.ram.get_manifest(JOB, 2, 0)
    _same(live, saved)
    assert sealed.chunk_crc32c == m.chunk_crc32c and sealed.crc32c == m.crc32c


def test_a_ram_hit_after_a_save_reads_the_savers_own_mapping(shm_dir: Path) -> None:
    saved = _state(11)
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1, copy_threads=2) as c:
        assert c.save(3, saved)
        c.wait()
        m = c.ram.get_manifest(JOB, 3, 0)
        path = c.ram.data_path(JOB, 3, 0)
        mapped = c.saver.mapping_of(path)  # the slot this save wrote, mapped by the saver
        assert mapped is not None and len(mapped) >= m.data_nbytes
        assert c.saver.mapping_of(shm_dir / "nowhere") is None
        other = shm_dir / "other.bin"
        other.write_bytes(b"x" * 16)
        assert c.saver.mapping_of(other) is None  # a file no slot mapping maps
        live = _state(12)
        with ThreadPoolExecutor(2) as pool:
            out = load_shard(live, m, path, pool=pool, workers=2, verify=True, mapped=mapped)
        _same(live, saved)
        assert out.chunk_crc32c == m.chunk_crc32c and out.crc32c == m.crc32c
        # a mapping shorter than the shard is refused before anything is written
        untouched = _state(13)
        before = copy.deepcopy(untouched)
        short = mmap.mmap(-1, 4096)
        with pytest.raises(ValueError, match="4096 bytes"):
            load_shard(untouched, m, path, pool=None, workers=1, verify=True, mapped=short)
        _same(untouched, before)
        short.close()


def test_a_corrupt_chunk_is_named_through_the_savers_mapping_too(shm_dir: Path) -> None:
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(1, _state(14))
        c.wait()
        m = c.ram.get_manifest(JOB, 1, 0)
        path = c.ram.data_path(JOB, 1, 0)
        mapped = c.saver.mapping_of(path)
        assert mapped is not None
        at = 8 * 1024 * 1024 + 5  # inside chunk 2
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x01]))
        with pytest.raises(ShardCorrupt, match="chunk 2 "):
            load_shard(_state(15), m, path, pool=None, workers=1, verify=True, mapped=mapped)


def test_a_shard_its_stager_verified_is_copied_without_a_checksum_pass(shm_dir: Path) -> None:
    saved = _state(16)
    m, path = _saved_shard(shm_dir, saved)
    live = _state(17)
    with ThreadPoolExecutor(2) as pool:
        out = load_shard(live, m, path, pool=pool, workers=3, verify=False, checksum=False)
    _same(live, saved)
    assert out.chunk_crc32c == [] and out.crc32c == 0
    # verify=True always checksums (checksum=False cannot turn verification off)
    out = load_shard(_state(18), m, path, pool=None, workers=1, verify=True, checksum=False)
    assert out.chunk_crc32c == m.chunk_crc32c


def _pvc_with_shard(tmp_path: Path, nbytes: int) -> tuple[PosixTier, bytes]:
    from tests.fixtures.gcs import make_shard

    src, m, data = make_shard(tmp_path, job_id=JOB, step=7, nbytes=nbytes, chunk_size=1 << 20)
    pvc = PosixTier(tmp_path / "pvc", "pvc")
    pvc.put_shard(JOB, 7, 0, src, m)
    return pvc, data


def _slot_files(ram: RamTier) -> list[os.stat_result]:
    d = slots_dir(ram.root, JOB, 0)
    return [os.stat(d / n) for n in sorted(os.listdir(d))]


def test_a_new_pods_restore_allocates_only_the_slot_its_copy_fills(
    shm_dir: Path, tmp_path: Path
) -> None:
    """Issue 14: staging into an empty RAM tier used to allocate the whole ring (keep + 1
    slots, every page zero-filled) before copying; now one slot, filled by the copy, then
    fully allocated and named a slot of the ring; the ring's other slots come later."""
    nbytes = 3 * (1 << 20) + 5
    pvc, data = _pvc_with_shard(tmp_path, nbytes)
    ram = RamTier(shm_dir / "ram")
    slots = LocalSlotProvider(ram, keep=1)
    d = slots_dir(ram.root, JOB, 0)
    d.mkdir(parents=True)
    (d / f"{STAGING_PREFIX}slot-0").write_bytes(b"left by a killed stager")
    res = stage_into_ram([ram, pvc], ram, slots, JOB, 7, 0, world_size=1)
    assert res.tier == "pvc" and not res.deferred_verify
    assert sorted(os.listdir(d)) == ["slot-0"]  # one slot, the stale file removed
    (st,) = _slot_files(ram)
    assert st.st_size == slot_size_for(nbytes)
    assert st.st_blocks * 512 >= st.st_size  # every page allocated (tmpfs: charged now)
    assert res.path.read_bytes()[:nbytes] == data
    assert ram.get_manifest(JOB, 7, 0).crc32c is not None  # committed in RAM: the next is a hit
    assert os.stat(res.path).st_ino == st.st_ino
    # The next save completes the ring and never takes the slot holding the restored step.
    nxt = slots.acquire_slot(JOB, 0, nbytes)
    assert nxt.name == "slot-1" and sorted(os.listdir(d)) == ["slot-0", "slot-1"]
    again = stage_into_ram([ram, pvc], ram, slots, JOB, 7, 0, world_size=1)
    assert again.tier == "ram"


def test_a_failed_copy_into_a_new_slot_leaves_nothing_behind(shm_dir: Path, tmp_path: Path) -> None:
    pvc, _data = _pvc_with_shard(tmp_path, 2 * (1 << 20))
    with open(pvc.data_path(JOB, 7, 0), "r+b") as f:  # a flipped byte in the PVC copy
        f.seek(1 << 20)
        b = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([b[0] ^ 1]))
    ram = RamTier(shm_dir / "ram")
    with pytest.raises(StageError, match="quarantined"):
        stage_into_ram([ram, pvc], ram, LocalSlotProvider(ram, keep=1), JOB, 7, 0, world_size=1)
    assert os.listdir(slots_dir(ram.root, JOB, 0)) == []


def test_start_up_pruning_removes_a_killed_stagers_slot_but_not_a_live_ones(shm_dir: Path) -> None:
    import fcntl

    from strata.sidecar.promotion.pruning import prune_ram

    ram = RamTier(shm_dir / "ram")
    d = slots_dir(ram.root, JOB, 0)
    d.mkdir(parents=True)
    dead = d / f"{STAGING_PREFIX}slot-0"
    dead.write_bytes(b"x" * 4096)
    d1 = slots_dir(ram.root, JOB, 1)
    d1.mkdir(parents=True)
    live = d1 / f"{STAGING_PREFIX}slot-0"
    live.write_bytes(b"y" * 4096)
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a stager still copying
        prune_ram(ram, JOB, keep=1)
        assert not dead.exists() and live.exists()


def _scan_until(d: str, stop: Any) -> None:
    while not stop.is_set():
        remove_stale_first_slots(Path(d))


def test_a_first_slot_being_created_is_never_taken_for_a_killed_stagers(shm_dir: Path) -> None:
    """A first slot is never visible unlocked: another process removing killed stagers' files
    in a loop (another staging of the rank, start-up pruning) never removes one a stager is
    creating. (Created by name then locked, about 1 in 800 was removed in that window, and the
    stager then named whatever file took the name meanwhile a slot of the ring.)"""
    root = shm_dir / "ram"
    d = slots_dir(root, JOB, 0)
    d.mkdir(parents=True)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    scanner = ctx.Process(target=_scan_until, args=(str(d), stop))
    scanner.start()
    made = lost = 0
    try:
        for _ in range(100_000):
            lock = first_slot(root, JOB, 0, 4096)
            if lock is None:  # the scanner held the name for a moment
                continue
            made += 1
            if path_identity(lock.path) != identity_of(os.fstat(lock.fd)):
                lost += 1
            remove_quietly(lock.path)
            lock.release()
            if made == 20_000:
                break
    finally:
        stop.set()
        scanner.join()
    assert made >= 1000
    assert lost == 0


def test_a_flipped_byte_anywhere_in_the_shard_is_refused(shm_dir: Path) -> None:
    """Every byte of the data object is under the one-pass check, whoever copies it: the first
    and last byte of every storage (fast tensors, the codec's non-contiguous view, the tensors of
    a ``state_dict()`` owner, bytes shared by two views) and of every gap between storages, read
    through a fresh mapping and through the saver's own mapping, with 1 or 3 threads."""
    with Checkpointer(job_id=JOB, ram_dir=shm_dir, rank=0, world_size=1) as c:
        assert c.save(1, _state(8))
        c.wait()
        m = c.ram.get_manifest(JOB, 1, 0)
        path = c.ram.data_path(JOB, 1, 0)
        saver_map = c.saver.mapping_of(path)
        assert saver_map is not None
        spots = {0, m.data_nbytes - 1}
        end = 0
        ordered = sorted(m.storages, key=lambda s: s.offset)
        for se in ordered[:14] + ordered[-4:]:  # the state's own; of the 300 small ones, 4
            if se.offset > end:
                spots |= {end, se.offset - 1}  # a gap (padding)
            if se.nbytes:
                spots |= {se.offset, se.offset + se.nbytes - 1}
            end = se.offset + se.nbytes
        with ThreadPoolExecutor(2) as pool:
            for i, at in enumerate(sorted(spots)):
                with open(path, "r+b") as f:
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0x01]))
                try:
                    mapped = saver_map if i % 2 else None
                    workers = 3 if i % 3 else 1
                    with pytest.raises(ShardCorrupt, match=f"chunk {at // m.chunk_size} "):
                        load_shard(
                            _state(9),
                            m,
                            path,
                            pool=pool,
                            workers=workers,
                            verify=True,
                            mapped=mapped,
                        )
                finally:
                    with open(path, "r+b") as f:
                        f.seek(at)
                        f.write(b)
        out = load_shard(_state(9), m, path, pool=None, workers=1, verify=True)
        assert out.chunk_crc32c == m.chunk_crc32c


def test_live_tensors_sharing_memory_that_were_saved_apart_load_and_verify(shm_dir: Path) -> None:
    """Two saved tensors of other bytes loading into the same live memory (tied weights restored
    from an untied checkpoint): a good shard is not called corrupt (threads checksummed what
    another thread was overwriting: 19 of 20 loads failed verification), the last one in the
    walk wins (as with ``Tensor.copy_``), and a flipped byte in either is still refused."""
    g = torch.Generator().manual_seed(3)
    n = 8 * 1024 * 1024 // 4  # 8 MiB each: several chunks, split between the threads
    saved = {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g)}
    m, path = _saved_shard(shm_dir, saved)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            tied = torch.zeros(n)
            load_shard({"a": tied, "b": tied}, m, path, pool=pool, workers=3, verify=True)
            assert torch.equal(tied, saved["b"])
        for name in ("a", "b"):
            se = m.storages[m.tensors[0 if name == "a" else 1].storage]
            at = se.offset + se.nbytes // 2
            with open(path, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x08]))
            try:
                tied = torch.zeros(n)
                with pytest.raises(ShardCorrupt, match=f"chunk {at // m.chunk_size} "):
                    load_shard({"a": tied, "b": tied}, m, path, pool=pool, workers=3, verify=True)
            finally:
                with open(path, "r+b") as f:
                    f.seek(at)
                    f.write(b)
