"""PVC (POSIX) tier on real directories: commit protocol, verification, quarantine, ENOSPC."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from strata.errors import ShardCorrupt, ShardUnavailable, TierError, TierFull
from strata.format import crc, layout
from strata.format.manifest import Manifest, StorageEntry
from strata.tiers.posix import PosixTier

pytestmark = pytest.mark.integration
JOB = "ns.train"


def make_shard(
    d: Path, step: int, rank: int = 0, nbytes: int = 10_000, world_size: int = 1, chunk: int = 4096
) -> tuple[Path, Manifest, bytes]:
    """A source file (random bytes, plus slack like a RAM slot) and its checksummed manifest."""
    data = os.urandom(nbytes)
    src = d / f"src-{step}-{rank}"
    src.write_bytes(data + b"slack-after-the-data")
    chunks, whole = crc.chunk_crcs(data, chunk_size=chunk)
    m = Manifest(
        job_id=JOB,
        step=step,
        rank=rank,
        world_size=world_size,
        writer_id="test",
        tree={"x": 1},
        tensors=[],
        storages=[StorageEntry(offset=0, nbytes=nbytes)],
        data_nbytes=nbytes,
        chunk_size=chunk,
        chunk_crc32c=chunks,
        crc32c=whole,
    )
    return src, m, data


def test_commit_protocol_and_fetch(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, data = make_shard(tmp_path, 100, rank=1, world_size=2)
    assert tier.put_shard(JOB, 100, 1, src, m) == len(data)
    d = tier.step_dir(JOB, 100)
    assert sorted(os.listdir(d)) == ["rank-00001.data", "rank-00001.manifest"]  # no temp files
    assert tier.data_path(JOB, 100, 1).read_bytes() == data  # exactly data_nbytes, no slack
    listing = tier.list_steps(JOB)[100]
    assert listing.committed_ranks == {1} and listing.world_size == 2 and not listing.complete
    dst = tmp_path / "dst"
    dst.write_bytes(b"\xee" * (len(data) + 50))  # like a longer RAM slot: not truncated
    got = tier.fetch_shard(JOB, 100, 1, dst)
    assert got == m
    assert dst.read_bytes()[: len(data)] == data and dst.stat().st_size == len(data) + 50
    # idempotent: the same shard again writes nothing
    assert tier.put_shard(JOB, 100, 1, src, m) == 0


def test_partial_step_is_listed_as_partial(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path)
    src, m, _ = make_shard(tmp_path, 7)
    tier.put_shard(JOB, 7, 0, src, m)
    tier.manifest_path(JOB, 7, 0).unlink()
    listing = tier.list_steps(JOB)[7]
    assert listing.committed_ranks == frozenset() and listing.partial_ranks == {0}
    with pytest.raises(ShardUnavailable, match="no manifest"):
        tier.get_manifest(JOB, 7, 0)


def test_flipped_byte_is_detected_and_quarantined(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, _ = make_shard(tmp_path, 5, nbytes=20_000)
    tier.put_shard(JOB, 5, 0, src, m)
    p = tier.data_path(JOB, 5, 0)
    raw = bytearray(p.read_bytes())
    raw[9000] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(ShardCorrupt, match=r"chunk 2 \(from byte 8192\)"):
        tier.fetch_shard(JOB, 5, 0, tmp_path / "dst")
    tier.quarantine(JOB, 5, 0, "test flip")
    names = os.listdir(tier.step_dir(JOB, 5))
    assert not any(layout.parse_shard(n) for n in names)  # no longer served
    assert any(n.startswith("rank-00000.manifest.quarantined-") for n in names)
    assert any(n.startswith("rank-00000.data.quarantined-") for n in names)
    assert 5 not in tier.list_steps(JOB) or not tier.list_steps(JOB)[5].committed_ranks


def test_truncated_data_is_corrupt(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, data = make_shard(tmp_path, 5)
    tier.put_shard(JOB, 5, 0, src, m)
    os.truncate(tier.data_path(JOB, 5, 0), len(data) - 1)
    with pytest.raises(ShardCorrupt, match="truncated"):
        tier.fetch_shard(JOB, 5, 0, tmp_path / "dst")


def test_corrupt_source_is_never_promoted(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, _ = make_shard(tmp_path, 5)
    raw = bytearray(src.read_bytes())
    raw[3] ^= 0xFF
    src.write_bytes(bytes(raw))
    with pytest.raises(ShardCorrupt, match="CRC32C mismatch"):
        tier.put_shard(JOB, 5, 0, src, m)
    assert 5 not in tier.list_steps(JOB)


def test_a_corrupt_source_never_costs_the_committed_copy_it_would_replace(tmp_path: Path) -> None:
    """The source is checksummed while it is copied (issue 14); a bad one is found before the
    copy already committed for that shard is un-committed."""
    tier = PosixTier(tmp_path / "pvc")
    old_src, old_m, old_data = make_shard(tmp_path, 5)
    tier.put_shard(JOB, 5, 0, old_src, old_m)
    (tmp_path / "new").mkdir()
    src, m, _ = make_shard(tmp_path / "new", 5)
    raw = bytearray(src.read_bytes())
    raw[5000] ^= 0x01
    src.write_bytes(bytes(raw))
    with pytest.raises(ShardCorrupt, match="CRC32C mismatch"):
        tier.put_shard(JOB, 5, 0, src, m)
    assert tier.get_manifest(JOB, 5, 0).crc32c == old_m.crc32c
    assert tier.data_path(JOB, 5, 0).read_bytes()[: len(old_data)] == old_data


def test_unchecksummed_manifest_is_refused(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, _ = make_shard(tmp_path, 5)
    with pytest.raises(TierError, match="no checksums"):
        tier.put_shard(JOB, 5, 0, src, m.model_copy(update={"crc32c": None, "chunk_crc32c": None}))


@pytest.mark.parametrize(
    ("patch", "exc", "match"),
    [
        ({"job_id": "other.job"}, ShardUnavailable, "manifest of job 'other.job'"),
        ({"format_version": 99}, ShardUnavailable, "format version 99"),
        ({"step": 6}, ShardCorrupt, r"step 6 != 5"),
    ],
)
def test_foreign_manifests_are_rejected_clearly(
    tmp_path: Path, patch: dict[str, object], exc: type[Exception], match: str
) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, _ = make_shard(tmp_path, 5)
    tier.put_shard(JOB, 5, 0, src, m)
    tier.manifest_path(JOB, 5, 0).write_bytes(m.model_copy(update=patch).to_json())
    with pytest.raises(exc, match=match):
        tier.get_manifest(JOB, 5, 0)


def test_malformed_manifest_is_corrupt(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    src, m, _ = make_shard(tmp_path, 5)
    tier.put_shard(JOB, 5, 0, src, m)
    tier.manifest_path(JOB, 5, 0).write_bytes(b'{"format": "strata-shard", "job_id": ')
    with pytest.raises(ShardCorrupt, match=r"malformed manifest .*rank-00000\.manifest"):
        tier.get_manifest(JOB, 5, 0)


def test_delete_step_removes_manifests_first_and_keeps_other_ranks(tmp_path: Path) -> None:
    tier = PosixTier(tmp_path / "pvc")
    for r in (0, 1):
        src, m, _ = make_shard(tmp_path, 9, rank=r, world_size=2)
        tier.put_shard(JOB, 9, r, src, m)
    assert tier.complete_steps(JOB) == [9]
    tier.delete_step(JOB, 9, frozenset({1}))
    assert tier.list_steps(JOB)[9].committed_ranks == {0}
    assert not tier.data_path(JOB, 9, 1).exists()
    tier.delete_step(JOB, 9)
    assert not tier.step_dir(JOB, 9).exists()


def test_enospc_raises_tierfull_and_keeps_previous_step(
    tmp_path: Path, small_tmpfs: Callable[[int], Path]
) -> None:
    root = small_tmpfs(256 * 1024)
    tier = PosixTier(root)
    src, m, data = make_shard(tmp_path, 1, nbytes=100_000)
    tier.put_shard(JOB, 1, 0, src, m)
    big_src, big_m, _ = make_shard(tmp_path, 2, nbytes=400_000)
    with pytest.raises(
        TierFull, match=r"no space left on the pvc tier .*rank-00000\.data.*previous"
    ):
        tier.put_shard(JOB, 2, 0, big_src, big_m)
    assert not tier.step_dir(JOB, 2).exists()  # its own partial file (and empty dir) removed
    assert tier.complete_steps(JOB) == [1]
    tier.fetch_shard(JOB, 1, 0, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
