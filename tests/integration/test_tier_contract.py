"""One contract, every tier: RAM (real tmpfs), PVC (a POSIX directory), GCS (fake-gcs-server).

The restore planner and the promotion engine treat tiers alike, so each must behave alike
(strata.tiers.base): a shard is committed exactly when its manifest is there, what is fetched is
what was put, a bad copy is detected and un-committed by quarantine, a failed put commits nothing,
and deleting a step never touches another step. Every method of :class:`Tier` is exercised on
every tier here, the optional abilities with defaults too (``data_path``, ``read_in_place``,
``verify_shard``, ``gc_incomplete``, ``close``, ``put_shard(verify_source=False)``). A tier
module that does not exist yet is skipped.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from strata.errors import ShardCorrupt, ShardUnavailable, TierError
from strata.format import layout
from strata.format.crc import chunk_crcs
from strata.format.manifest import Manifest, StorageEntry
from strata.tiers.base import Tier
from tests.fixtures.gcs import make_shard

pytestmark = pytest.mark.integration

JOB = "team.train"
WRITER = "contract-writer"


@dataclass
class TierUnderTest:
    """A tier plus raw access to its storage, to fake crashes and corruption."""

    kind: str
    tier: Tier
    write_raw: Callable[[str, bytes], None]
    """Store bytes under a layout key, bypassing the tier (a crashed writer's leftovers)."""
    read_raw: Callable[[str], bytes]
    stored_keys: Callable[[], set[str]]
    """Layout keys of everything stored for JOB."""

    def flip_byte(self, key: str, offset: int) -> None:
        raw = bytearray(self.read_raw(key))
        raw[offset] ^= 0x5A
        self.write_raw(key, bytes(raw))


def _posix_access(
    root: Path,
) -> tuple[Callable[[str, bytes], None], Callable[[str], bytes], Callable[[], set[str]]]:
    def write_raw(key: str, data: bytes) -> None:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        # In place (r+b), not a new file: a RAM-tier data file is a hard link to a slot.
        mode = "r+b" if path.exists() else "wb"
        with open(path, mode) as f:
            f.write(data)

    def read_raw(key: str) -> bytes:
        return (root / key).read_bytes()

    def keys() -> set[str]:
        base = root / layout.steps_prefix(JOB)
        if not base.exists():
            return set()
        return {str(p.relative_to(root)) for p in base.rglob("*") if p.is_file()}

    return write_raw, read_raw, keys


def _import_tier(module: str) -> object:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            pytest.skip(f"{module} is not written yet")
        raise


@pytest.fixture(params=["ram", "pvc", "gcs"])
def tut(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierUnderTest]:
    kind = request.param
    if kind == "gcs":
        from strata.tiers.gcs import META_WRITER, GcsTier

        emulator = request.getfixturevalue("gcs_emulator")
        bucket_name = request.getfixturevalue("gcs_bucket")
        admin = emulator.client()
        bucket = admin.bucket(bucket_name)
        prefix = "contract"

        def write_raw(key: str, data: bytes) -> None:
            blob = bucket.blob(f"{prefix}/{key}")
            blob.metadata = {META_WRITER: WRITER}
            blob.upload_from_string(data)

        def read_raw(key: str) -> bytes:
            return bytes(bucket.blob(f"{prefix}/{key}").download_as_bytes())

        def keys() -> set[str]:
            return {
                b.name.removeprefix(f"{prefix}/")
                for b in admin.list_blobs(bucket_name, prefix=f"{prefix}/{JOB}/")
            }

        with GcsTier(
            emulator.tier_config(bucket_name, prefix=prefix), writer_id=WRITER, retry_timeout=10
        ) as tier:
            yield TierUnderTest(kind, tier, write_raw, read_raw, keys)
    elif kind == "pvc":
        posix = _import_tier("strata.tiers.posix")
        root = tmp_path / "pvc"
        root.mkdir()
        tier = posix.PosixTier(root)  # type: ignore[attr-defined]
        yield TierUnderTest(kind, tier, *_posix_access(root))
    else:
        ram = _import_tier("strata.tiers.ram")
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no tmpfs at /dev/shm")
        root = Path(
            tempfile.mkdtemp(prefix=f"strata-contract-{uuid.uuid4().hex[:6]}-", dir="/dev/shm")
        )
        try:
            # keep covers every step a test writes: retention is not what is tested here.
            tier = ram.RamTier(root, keep=8)  # type: ignore[attr-defined]
            yield TierUnderTest(kind, tier, *_posix_access(root))
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _put(
    tut: TierUnderTest,
    tmp_path: Path,
    step: int,
    rank: int,
    world_size: int = 1,
    nbytes: int = 5000,
    pad: int = 0,
) -> bytes:
    path, manifest, data = make_shard(
        tmp_path,
        job_id=JOB,
        step=step,
        rank=rank,
        world_size=world_size,
        nbytes=nbytes,
        chunk_size=1024,
        writer_id=WRITER,
        pad=pad,
    )
    tut.tier.put_shard(JOB, step, rank, path, manifest)
    return data


def _fetch(tut: TierUnderTest, tmp_path: Path, step: int, rank: int) -> bytes:
    dst = tmp_path / f"fetched-{uuid.uuid4().hex[:6]}.bin"
    tut.tier.fetch_shard(JOB, step, rank, dst)
    return dst.read_bytes()


def test_put_then_list_get_fetch(tut: TierUnderTest, tmp_path: Path) -> None:
    assert tut.tier.list_steps(JOB) == {}
    saved = {r: _put(tut, tmp_path, 10, r, world_size=2, nbytes=3000 + r) for r in (0, 1)}
    listing = tut.tier.list_steps(JOB)[10]
    assert listing.committed_ranks == {0, 1}
    assert listing.partial_ranks == frozenset()
    assert listing.world_size == 2
    assert listing.complete
    assert tut.tier.complete_steps(JOB) == [10]
    assert tut.tier.newest_complete_step(JOB) == 10
    for r in (0, 1):
        manifest = tut.tier.get_manifest(JOB, 10, r)
        assert (manifest.step, manifest.rank, manifest.data_nbytes) == (10, r, 3000 + r)
        assert _fetch(tut, tmp_path, 10, r) == saved[r]


def test_fetch_writes_only_the_shard_into_a_longer_destination(
    tut: TierUnderTest, tmp_path: Path
) -> None:
    """Only data_nbytes count, at both ends: a longer source (slot file) and a longer
    destination (a pre-faulted slot, not truncated)."""
    data = _put(tut, tmp_path, 3, 0, nbytes=2500, pad=777)
    assert _fetch(tut, tmp_path, 3, 0) == data
    dst = tmp_path / "slot.bin"
    tail = os.urandom(1000)
    dst.write_bytes(os.urandom(2500) + tail)
    tut.tier.fetch_shard(JOB, 3, 0, dst)
    assert dst.read_bytes() == data + tail


def test_absent_shard_is_unavailable_not_corrupt(tut: TierUnderTest, tmp_path: Path) -> None:
    _put(tut, tmp_path, 1, 0)
    for step, rank in ((1, 1), (2, 0)):
        with pytest.raises(ShardUnavailable) as err:
            tut.tier.get_manifest(JOB, step, rank)
        assert not isinstance(err.value, ShardCorrupt)
        with pytest.raises(ShardUnavailable):
            tut.tier.fetch_shard(JOB, step, rank, tmp_path / "x.bin")


def test_data_without_manifest_is_not_committed(tut: TierUnderTest, tmp_path: Path) -> None:
    """Manifest last: data alone (a writer killed before its manifest) is never served."""
    _put(tut, tmp_path, 100, 0, world_size=1)
    tut.write_raw(layout.data_key(JOB, 200, 0), os.urandom(4000))
    listing = tut.tier.list_steps(JOB)[200]
    assert listing.committed_ranks == frozenset()
    assert listing.partial_ranks == {0}
    assert not listing.complete
    assert tut.tier.complete_steps(JOB) == [100]
    with pytest.raises(ShardUnavailable):
        tut.tier.fetch_shard(JOB, 200, 0, tmp_path / "x.bin")


def test_corrupt_copy_is_detected_and_quarantine_uncommits_it(
    tut: TierUnderTest, tmp_path: Path
) -> None:
    good = _put(tut, tmp_path, 5, 0, nbytes=6000)
    other = _put(tut, tmp_path, 6, 0, nbytes=6000)
    tut.flip_byte(layout.data_key(JOB, 5, 0), 4321)
    with pytest.raises(ShardCorrupt, match="rank-00000"):
        tut.tier.fetch_shard(JOB, 5, 0, tmp_path / "bad.bin")
    with pytest.raises(ShardCorrupt):
        tut.tier.verify_shard(JOB, 5, 0)

    tut.tier.quarantine(JOB, 5, 0, reason="CRC32C mismatch (contract test)")
    with pytest.raises(ShardUnavailable):
        tut.tier.get_manifest(JOB, 5, 0)
    assert 5 not in tut.tier.complete_steps(JOB)
    assert _fetch(tut, tmp_path, 6, 0) == other  # the neighbour step is untouched
    # The quarantined copy is kept aside, never served, and never in the way of a good copy.
    assert any(layout.QUARANTINE_SUFFIX in k for k in tut.stored_keys())
    source = tmp_path / "good-copy.bin"  # e.g. the PVC's copy, promoted again
    source.write_bytes(good)
    tut.tier.put_shard(JOB, 5, 0, source, _manifest_for(good, 5))
    assert _fetch(tut, tmp_path, 5, 0) == good


def _manifest_for(data: bytes, step: int, rank: int = 0, world_size: int = 1) -> Manifest:
    crcs, whole = chunk_crcs(data, len(data), 1024)
    return Manifest(
        job_id=JOB,
        step=step,
        rank=rank,
        world_size=world_size,
        writer_id=WRITER,
        tree={"step": step},
        tensors=[],
        storages=[StorageEntry(offset=0, nbytes=len(data))],
        data_nbytes=len(data),
        chunk_size=1024,
        chunk_crc32c=crcs,
        crc32c=whole,
    )


def test_failed_put_commits_nothing_and_keeps_previous_steps(
    tut: TierUnderTest, tmp_path: Path
) -> None:
    """A source that does not match its manifest (corrupt RAM copy) or is truncated: an error,
    nothing committed for that shard, the previous committed step still served."""
    previous = _put(tut, tmp_path, 7, 0)
    path, manifest, data = make_shard(
        tmp_path, job_id=JOB, step=8, nbytes=5000, chunk_size=1024, writer_id=WRITER
    )
    bad = bytearray(data)
    bad[10] ^= 0x01
    path.write_bytes(bytes(bad))
    with pytest.raises(ShardCorrupt):
        tut.tier.put_shard(JOB, 8, 0, path, manifest)
    path.write_bytes(data[:4000])
    with pytest.raises((ShardCorrupt, TierError)):
        tut.tier.put_shard(JOB, 8, 0, path, manifest)
    with pytest.raises(ShardUnavailable):
        tut.tier.get_manifest(JOB, 8, 0)
    assert tut.tier.complete_steps(JOB) == [7]
    assert _fetch(tut, tmp_path, 7, 0) == previous


def test_putting_the_same_shard_again_is_harmless(tut: TierUnderTest, tmp_path: Path) -> None:
    path, manifest, data = make_shard(
        tmp_path, job_id=JOB, step=9, nbytes=3000, chunk_size=1024, writer_id=WRITER
    )
    tut.tier.put_shard(JOB, 9, 0, path, manifest)
    tut.tier.put_shard(JOB, 9, 0, path, manifest)
    assert tut.tier.list_steps(JOB)[9].committed_ranks == {0}
    assert _fetch(tut, tmp_path, 9, 0) == data


def test_delete_step_removes_that_step_only(tut: TierUnderTest, tmp_path: Path) -> None:
    saved = {
        (s, r): _put(tut, tmp_path, s, r, world_size=2, nbytes=2000 + s)
        for s in (1, 2, 3)
        for r in (0, 1)
    }
    tut.tier.delete_step(JOB, 2, ranks=frozenset({1}))
    assert tut.tier.list_steps(JOB)[2].committed_ranks == {0}
    assert tut.tier.complete_steps(JOB) == [1, 3]
    tut.tier.delete_step(JOB, 2)
    assert 2 not in tut.tier.list_steps(JOB)
    assert not [
        k
        for k in tut.stored_keys()
        if f"/{layout.step_name(2)}/rank-" in k and "quarantined" not in k
    ]
    for s in (1, 3):
        for r in (0, 1):
            assert _fetch(tut, tmp_path, s, r) == saved[(s, r)]
    tut.tier.delete_step(JOB, 2)  # deleting again is harmless


def test_verify_shard_checks_the_committed_copy(tut: TierUnderTest, tmp_path: Path) -> None:
    data = _put(tut, tmp_path, 11, 0, nbytes=4096)
    manifest = tut.tier.verify_shard(JOB, 11, 0)
    assert (manifest.step, manifest.rank, manifest.data_nbytes) == (11, 0, len(data))
    with pytest.raises(ShardUnavailable) as err:
        tut.tier.verify_shard(JOB, 12, 0)
    assert not isinstance(err.value, ShardCorrupt)
    tut.flip_byte(layout.data_key(JOB, 11, 0), 7)
    with pytest.raises(ShardCorrupt):
        tut.tier.verify_shard(JOB, 11, 0)


def test_data_path_is_the_data_file_or_none(tut: TierUnderTest, tmp_path: Path) -> None:
    """A tier the process can read as files names the data file; an object store names none."""
    data = _put(tut, tmp_path, 12, 0, nbytes=3000)
    path = tut.tier.data_path(JOB, 12, 0)
    if tut.kind == "gcs":
        assert path is None
    else:
        assert path is not None
        assert path.read_bytes()[: len(data)] == data


def test_read_in_place_serves_only_where_the_medium_allows(
    tut: TierUnderTest, tmp_path: Path
) -> None:
    """RAM serves a shard where it lies, verified; the others say None (copy it out)."""
    data = _put(tut, tmp_path, 13, 0, world_size=2, nbytes=3500)
    hit = tut.tier.read_in_place(JOB, 13, 0, world_size=2, verify=True)
    if tut.kind != "ram":
        assert hit is None
        return
    assert hit is not None
    assert hit.manifest.step == 13 and hit.manifest.data_nbytes == len(data)
    assert hit.path.read_bytes()[: len(data)] == data
    assert hit.notes == []
    with pytest.raises(ShardUnavailable):
        tut.tier.read_in_place(JOB, 13, 0, world_size=4, verify=True)
    with pytest.raises(ShardUnavailable):
        tut.tier.read_in_place(JOB, 14, 0, world_size=2, verify=True)
    tut.flip_byte(layout.data_key(JOB, 13, 0), 100)
    with pytest.raises(ShardCorrupt):
        tut.tier.read_in_place(JOB, 13, 0, world_size=2, verify=True)


def test_put_without_verifying_the_source_never_serves_bad_bytes(
    tut: TierUnderTest, tmp_path: Path
) -> None:
    """``verify_source=False`` skips the check before writing; a bad source is then refused by
    the tier (GCS compares the stored CRC32C) or caught by verify_shard and fetch_shard."""
    path, manifest, data = make_shard(
        tmp_path, job_id=JOB, step=15, nbytes=5000, chunk_size=1024, writer_id=WRITER
    )
    bad = bytearray(data)
    bad[20] ^= 0x01
    path.write_bytes(bytes(bad))
    try:
        tut.tier.put_shard(JOB, 15, 0, path, manifest, verify_source=False)
    except ShardCorrupt:
        with pytest.raises(ShardUnavailable):
            tut.tier.get_manifest(JOB, 15, 0)
        return
    with pytest.raises(ShardCorrupt):
        tut.tier.verify_shard(JOB, 15, 0)
    with pytest.raises(ShardCorrupt):
        tut.tier.fetch_shard(JOB, 15, 0, tmp_path / "bad.bin")


def test_gc_incomplete_never_touches_committed_shards(tut: TierUnderTest, tmp_path: Path) -> None:
    """Whatever a medium collects (GCS: leftovers of interrupted uploads), committed shards and
    the newest complete step survive, and what was deleted is listed."""
    older = _put(tut, tmp_path, 20, 0)
    newest = _put(tut, tmp_path, 30, 0)
    tut.write_raw(layout.data_key(JOB, 25, 0), os.urandom(2000))  # a crashed writer's data
    deleted = tut.tier.gc_incomplete(JOB, 0.0)
    assert isinstance(deleted, list) and all(isinstance(d, str) for d in deleted)
    assert not [d for d in deleted if d.endswith(layout.MANIFEST_SUFFIX)]
    assert tut.tier.complete_steps(JOB) == [20, 30]
    assert _fetch(tut, tmp_path, 20, 0) == older
    assert _fetch(tut, tmp_path, 30, 0) == newest


def test_close_releases_and_is_harmless_to_repeat(tut: TierUnderTest, tmp_path: Path) -> None:
    _put(tut, tmp_path, 40, 0)
    tut.tier.close()
    tut.tier.close()
