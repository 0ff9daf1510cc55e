"""The one-pass checked copy behind PVC promotion (issue 14, item 5) on real files: tmpfs to the
local disk, with writeback, and the bytes checked are the bytes written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strata.errors import ShardCorrupt
from strata.format import crc
from strata.tiers.checked_copy import BLOCK_BYTES, WRITEBACK_BYTES, copy_checked

pytestmark = pytest.mark.integration


def _copy(src: Path, dst: Path, data: bytes, chunk: int, writeback: bool = True) -> None:
    chunks, whole = crc.chunk_crcs(data, chunk_size=chunk)
    sfd = os.open(src, os.O_RDONLY)
    dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        copy_checked(
            sfd, dfd, len(data), chunk, chunks, whole, src_name=str(src), writeback=writeback
        )
    finally:
        os.close(sfd)
        os.close(dfd)


@pytest.mark.parametrize(
    ("nbytes", "chunk"),
    [
        (10_000, 4096),  # chunks smaller than a block, a short last chunk
        (2 * 3 * BLOCK_BYTES + 12_345, 3 * BLOCK_BYTES),  # several blocks per chunk
        (WRITEBACK_BYTES + 5 * BLOCK_BYTES + 1, 4 * BLOCK_BYTES),  # writeback started mid-copy
        (1, 4096),
    ],
)
def test_copies_exactly_the_shard_from_a_longer_source(
    shm_dir: Path, tmp_path: Path, nbytes: int, chunk: int
) -> None:
    data = os.urandom(nbytes)
    src = shm_dir / "slot"
    src.write_bytes(data + b"slack of a RAM slot")
    dst = tmp_path / "copy"
    _copy(src, dst, data, chunk)
    assert dst.read_bytes() == data


def test_a_bad_chunk_raises_naming_it_and_the_source(shm_dir: Path, tmp_path: Path) -> None:
    chunk = 64 * 1024
    data = os.urandom(10 * chunk)
    bad = bytearray(data)
    bad[3 * chunk + 17] ^= 0x01
    src = shm_dir / "slot"
    src.write_bytes(bytes(bad))
    with pytest.raises(ShardCorrupt, match=rf"{src}: CRC32C mismatch in chunk 3 \(from byte"):
        _copy(src, tmp_path / "copy", data, chunk)


def test_a_short_source_is_truncated_not_padded(shm_dir: Path, tmp_path: Path) -> None:
    data = os.urandom(100_000)
    src = shm_dir / "slot"
    src.write_bytes(data[:70_000])
    with pytest.raises(ShardCorrupt, match=r"ends at byte 70000.*truncated"):
        _copy(src, tmp_path / "copy", data, 4096)


def test_a_manifest_with_the_wrong_number_of_chunk_crcs_is_refused(
    shm_dir: Path, tmp_path: Path
) -> None:
    data = os.urandom(10_000)
    src = shm_dir / "slot"
    src.write_bytes(data)
    chunks, whole = crc.chunk_crcs(data, chunk_size=4096)
    fd = os.open(src, os.O_RDONLY)
    out = os.open(tmp_path / "copy", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(ShardCorrupt, match="2 chunk CRC32Cs for 10000 bytes"):
            copy_checked(fd, out, 10_000, 4096, chunks[:2], whole, src_name=str(src))
    finally:
        os.close(fd)
        os.close(out)
