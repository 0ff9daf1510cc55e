"""CRC32C helpers: combine equals the checksum of the concatenation; chunking; files."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.format import crc

pytestmark = pytest.mark.unit


def test_known_vector() -> None:
    # RFC 3720 (iSCSI) B.4: CRC32C of 32 zero bytes is 0x8A9136AA.
    assert crc.crc32c(bytes(32)) == 0x8A9136AA
    assert crc.crc32c(b"123456789") == 0xE3069283


@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    whole = google_crc32c.value(a + b)
    assert crc.crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == whole


def test_combine_large_length() -> None:
    b = os.urandom(1 << 20) + bytes(3)
    a = b"prefix"
    assert crc.crc32c_combine(crc.crc32c(a), crc.crc32c(b), len(b)) == crc.crc32c(a + b)


def test_extend_continues() -> None:
    assert crc.crc32c(b"world", crc.crc32c(b"hello ")) == crc.crc32c(b"hello world")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096, 10_000])
def test_chunk_crcs_combine_to_whole(nbytes: int, threads: int) -> None:
    data = os.urandom(nbytes + 17)  # a longer buffer: only the first nbytes count
    chunks, whole = crc.chunk_crcs(data, nbytes, chunk_size=4096, threads=threads)
    assert len(chunks) == crc.n_chunks(nbytes, 4096)
    assert chunks == [
        google_crc32c.value(data[i : min(i + 4096, nbytes)]) for i in range(0, nbytes, 4096)
    ]
    assert whole == (google_crc32c.value(data[:nbytes]) if nbytes else 0)


def test_file_chunk_crcs_and_truncation(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    p = tmp_path / "x.data"
    p.write_bytes(data)
    chunks, whole = crc.file_chunk_crcs(p, 40_000, chunk_size=8192, threads=2)
    assert whole == google_crc32c.value(data[:40_000])
    assert crc.combine_chunks(chunks, 40_000, 8192) == whole
    with pytest.raises(ValueError, match=r"x\.data holds 50000 bytes"):
        crc.file_chunk_crcs(p, 60_000)


def test_first_bad_chunk() -> None:
    assert crc.first_bad_chunk([1, 2, 3], [1, 2, 3]) is None
    assert crc.first_bad_chunk([1, 9, 3], [1, 2, 3]) == 1
    assert crc.first_bad_chunk([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("nbytes", [0, 1, 1023, 1024, 1025, 4096, 4097, 10_000])
def test_sub_chunk_crcs_join_to_the_chunks(nbytes: int, threads: int) -> None:
    data = bytearray(os.urandom(nbytes + 17))
    chunks, whole, pieces = crc.chunk_and_sub_crcs(data, nbytes, 4096, 1024, threads=threads)
    assert (chunks, whole) == crc.chunk_crcs(data, nbytes, chunk_size=4096)
    assert pieces == [
        google_crc32c.value(bytes(data[i : min(i + 1024, nbytes)])) for i in range(0, nbytes, 1024)
    ]
    assert crc.join_pieces(pieces, nbytes, 1024) == whole
    with pytest.raises(ValueError, match="does not divide"):
        crc.chunk_and_sub_crcs(data, nbytes, 4096, 1000)


def test_a_length_past_the_buffer_is_refused_and_leaves_the_buffer_free() -> None:
    """A caller that closes its slot mapping while handling the refusal can: the error names
    both sizes and no view of the mapping is left in the error's frames (``mmap.close`` raises
    BufferError while one is exported)."""
    calls = [
        lambda mm: crc.chunk_crcs(mm, 8193, chunk_size=4096, threads=2),
        lambda mm: crc.chunk_and_sub_crcs(mm, 8193, 4096, 1024, threads=2),
    ]
    for call in calls:
        mm = mmap.mmap(-1, 8192)
        try:
            call(mm)
        except ValueError as exc:
            assert str(exc) == "asked to checksum 8193 bytes of a 8192-byte buffer"
            mm.close()  # the traceback (and its frames) is alive here
        assert mm.closed


def test_sub_chunk_size_only_splits_chunks() -> None:
    assert crc.sub_chunk_size(4 * 1024 * 1024) == 128 * 1024
    assert crc.sub_chunk_size(128 * 1024) is None  # one piece per chunk: nothing to gain
    assert crc.sub_chunk_size(3 * 100_000) is None  # not a multiple


def test_sub_chunk_record_round_trips() -> None:
    from strata.format.manifest import SubChunkCrcs

    values = [0, 1, 2**32 - 1, 0x8A9136AA]
    rec = SubChunkCrcs.of(values, 1024)
    again = SubChunkCrcs.model_validate_json(rec.model_dump_json())
    assert again == rec and again.values() == tuple(values)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        SubChunkCrcs(size=1024, crc32c="AAAA").values()
