"""GcsTier against the real fake-gcs-server with the real google-cloud-storage client.

Covers docs/architecture.md "Commit protocol" for GCS: CRC32C on every object, create-only uploads
(``if_generation_match=0``), manifest last (C-09), data without a manifest ignored and
garbage-collected only after a grace period (C-08), a 412 on the retry of an upload that landed,
parallel composite uploads and parallel ranged downloads, and errors naming ``gs://`` objects.

fake-gcs-server enforces preconditions on simple uploads only, so every 412 test here goes
through a simple upload.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.cloud import storage

from strata.errors import ShardCorrupt, ShardUnavailable
from strata.format import layout
from strata.testing.emulator import free_port
from strata.tiers.gcs import (
    META_DATA_GENERATION,
    META_QUARANTINE_REASON,
    META_WRITER,
    PART_MARKER,
    TRANSFER_ATTEMPTS,
    GcsBucketNotFound,
    GcsConflict,
    GcsPermissionDenied,
    GcsTier,
    GcsUnreachable,
    SourceCorrupt,
    TransferCorrupt,
    crc32c_of_b64,
)
from tests.fixtures.gcs import GcsEmulator, make_shard

pytestmark = pytest.mark.integration

JOB = "ns.job"
WRITER = "pod-a"
CHUNK = 256 * 1024


@pytest.fixture
def tier(gcs_emulator: GcsEmulator, gcs_bucket: str) -> Iterator[GcsTier]:
    with GcsTier(
        gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/"),
        writer_id=WRITER,
        retry_timeout=10,
    ) as t:
        yield t


@pytest.fixture
def admin(gcs_emulator: GcsEmulator) -> storage.Client:
    return gcs_emulator.client()


def _names(admin: storage.Client, bucket: str) -> set[str]:
    return {b.name for b in admin.list_blobs(bucket)}


def _commit(tier: GcsTier, tmp_path: Path, **kw: object) -> tuple[Path, bytes]:
    path, manifest, data = make_shard(tmp_path, job_id=JOB, writer_id=WRITER, **kw)  # type: ignore[arg-type]
    assert tier.put_shard(JOB, manifest.step, manifest.rank, path, manifest) == len(data)
    return path, data


@pytest.mark.parametrize(
    ("nbytes", "pad"),
    [(0, 0), (1, 0), (CHUNK, 0), (CHUNK, 4096), (5 * CHUNK + 12345, 0), (3 * CHUNK + 1, 70000)],
    ids=["empty", "one-byte", "one-chunk", "slot-file-simple", "composite", "slot-file-composite"],
)
def test_round_trip_bytes(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path, nbytes: int, pad: int
) -> None:
    """What is fetched equals what was saved, for simple and parallel composite uploads, also
    when the source file is longer than the shard (a RAM slot file: only data_nbytes count)."""
    path, manifest, data = make_shard(
        tmp_path, job_id=JOB, step=7, rank=3, world_size=4, nbytes=nbytes, pad=pad
    )
    assert tier.put_shard(JOB, 7, 3, path, manifest) == nbytes

    listing = tier.list_steps(JOB)[7]
    assert listing.committed_ranks == {3}
    assert listing.partial_ranks == frozenset()
    assert listing.world_size == 4
    assert listing.mtime is not None
    assert tier.get_manifest(JOB, 7, 3) == manifest

    fresh = tmp_path / "fetched.bin"
    assert tier.fetch_shard(JOB, 7, 3, fresh) == manifest
    assert fresh.read_bytes() == data
    # Into a longer, pre-allocated file (a RAM slot): not truncated, the tail is left alone.
    slot = tmp_path / "slot.bin"
    tail = os.urandom(3000)
    slot.write_bytes(os.urandom(nbytes) + tail)
    tier.fetch_shard(JOB, 7, 3, slot)
    assert slot.read_bytes() == data + tail

    stored = admin.bucket(gcs_bucket).get_blob(f"ckpt/{layout.data_key(JOB, 7, 3)}")
    assert stored is not None
    assert stored.size == nbytes
    assert crc32c_of_b64(stored.crc32c) == manifest.crc32c
    assert stored.metadata[META_WRITER] == WRITER
    # The temporary parts of a composite upload are gone.
    assert not [n for n in _names(admin, gcs_bucket) if PART_MARKER in n]


def test_composite_upload_uses_parallel_parts(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """A shard larger than chunk_size is composed from several parts (a composite object)."""
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=1, nbytes=4 * CHUNK + 5)
    tier.put_shard(JOB, 1, 0, path, manifest)
    stored = admin.bucket(gcs_bucket).get_blob(f"ckpt/{layout.data_key(JOB, 1, 0)}")
    assert stored is not None
    assert stored.component_count in (None, 5)  # fake-gcs-server does not report it
    assert crc32c_of_b64(stored.crc32c) == manifest.crc32c


def test_parts_above_the_clients_8_mib_multipart_limit_upload_and_round_trip(
    gcs_emulator: GcsEmulator, gcs_bucket: str, tmp_path: Path
) -> None:
    """Parts over 8 MiB go up as resumable uploads, which refuse a stream not at position 0:
    every part after the first used to fail ("Stream must be at beginning"), i.e. every shard
    over 2 x chunk_size with chunk_size > 8 MiB (found by bench/, W1 at 0.1 scale)."""
    chunk = 9 * 1024 * 1024
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=3, nbytes=2 * chunk + 11)
    cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/", chunk_size_bytes=chunk)
    with GcsTier(cfg, writer_id=WRITER, client=gcs_emulator.client()) as tier:
        assert tier.put_shard(JOB, 3, 0, path, manifest) == len(data)
        out = tmp_path / "back.bin"
        tier.fetch_shard(JOB, 3, 0, out)
    assert out.read_bytes()[: len(data)] == data


def test_crc_mismatch_is_detected_and_quarantined(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """Bytes flipped in the stored data object: fetch raises ShardCorrupt naming the object;
    quarantine un-commits it (kept aside with the reason), and the shard can be re-promoted."""
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=5, nbytes=3 * CHUNK)
    tier.put_shard(JOB, 5, 0, path, manifest)
    name = f"ckpt/{layout.data_key(JOB, 5, 0)}"
    flipped = bytearray(data)
    flipped[CHUNK + 17] ^= 0xFF
    admin.bucket(gcs_bucket).blob(name).upload_from_string(bytes(flipped))

    with pytest.raises(ShardCorrupt, match=f"gs://{gcs_bucket}/{name}"):
        tier.verify_shard(JOB, 5, 0)
    with pytest.raises(ShardCorrupt, match=f"gs://{gcs_bucket}/{name}"):
        tier.fetch_shard(JOB, 5, 0, tmp_path / "out.bin")

    tier.quarantine(JOB, 5, 0, reason="crc mismatch at restore")
    assert 5 not in tier.list_steps(JOB)
    with pytest.raises(ShardUnavailable):
        tier.get_manifest(JOB, 5, 0)
    aside = [b for b in admin.list_blobs(gcs_bucket) if layout.QUARANTINE_SUFFIX in b.name]
    assert {b.name.split(layout.QUARANTINE_SUFFIX)[0] for b in aside} == {
        name,
        f"ckpt/{layout.manifest_key(JOB, 5, 0)}",
    }
    assert all(b.metadata[META_QUARANTINE_REASON] == "crc mismatch at restore" for b in aside)
    tier.quarantine(JOB, 5, 0, reason="again")  # nothing left to move: harmless

    # A good copy (e.g. from the PVC) can be promoted again.
    tier.put_shard(JOB, 5, 0, path, manifest)
    tier.fetch_shard(JOB, 5, 0, tmp_path / "again.bin")
    assert (tmp_path / "again.bin").read_bytes() == data


@pytest.mark.parametrize("nbytes", [1000, 3 * CHUNK], ids=["simple", "composite"])
def test_source_not_matching_manifest_commits_nothing(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path, nbytes: int
) -> None:
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=9, nbytes=nbytes)
    corrupt = bytearray(data)
    corrupt[nbytes // 2] ^= 0x40
    path.write_bytes(bytes(corrupt))
    with pytest.raises(SourceCorrupt, match=str(path)):
        tier.put_shard(JOB, 9, 0, path, manifest)
    assert _names(admin, gcs_bucket) == set()
    assert tier.list_steps(JOB) == {}


def _leave_uncommitted(
    admin: storage.Client, bucket: str, step: int, rank: int, writer: str = WRITER
) -> str:
    """What a writer killed between data and manifest leaves behind."""
    name = f"ckpt/{layout.data_key(JOB, step, rank)}"
    blob = admin.bucket(bucket).blob(name)
    blob.metadata = {META_WRITER: writer}
    blob.upload_from_string(os.urandom(2000), if_generation_match=0)
    return name


def test_c08_data_without_manifest_is_ignored_and_collected_after_grace(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    for step in (100, 300):
        for rank in (0, 1):
            _commit(tier, tmp_path, step=step, rank=rank, world_size=2, nbytes=3000)
    crashed = [_leave_uncommitted(admin, gcs_bucket, 200, r) for r in (0, 1)]
    in_flight = _leave_uncommitted(admin, gcs_bucket, 400, 0)
    foreign = _leave_uncommitted(admin, gcs_bucket, 250, 0, writer="pod-b")
    # Step 100 also gets a stray data object for a rank that never committed.
    stray = _leave_uncommitted(admin, gcs_bucket, 100, 5)

    steps = tier.list_steps(JOB)
    assert steps[200].committed_ranks == frozenset()
    assert steps[200].partial_ranks == {0, 1}
    assert not steps[200].complete
    # Restore planning only sees complete steps.
    assert tier.complete_steps(JOB) == [100, 300]
    assert tier.newest_complete_step(JOB) == 300
    with pytest.raises(ShardUnavailable):
        tier.fetch_shard(JOB, 200, 0, tmp_path / "x.bin")

    before = _names(admin, gcs_bucket)
    assert tier.gc_incomplete(JOB, grace_seconds=3600) == []
    assert _names(admin, gcs_bucket) == before

    later = time.time() + 3601
    deleted = tier.gc_incomplete(JOB, grace_seconds=3600, now=later)
    assert sorted(deleted) == sorted(f"gs://{gcs_bucket}/{n}" for n in [*crashed, stray])
    after = _names(admin, gcs_bucket)
    assert after == before - {*crashed, stray}
    assert in_flight in after  # newer than the newest complete step: a save may be in flight
    assert foreign in after  # not written by this writer
    assert tier.complete_steps(JOB) == [100, 300]
    for step in (100, 300):
        for rank in (0, 1):
            tier.fetch_shard(JOB, step, rank, tmp_path / "ok.bin")

    assert tier.gc_incomplete(JOB, grace_seconds=0, now=later, any_writer=True) == [
        f"gs://{gcs_bucket}/{foreign}"
    ]


def test_c08_gc_never_deletes_a_committed_step(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """Committed shards (manifest present) survive GC however old, also in incomplete steps."""
    _commit(tier, tmp_path, step=10, rank=0, world_size=2)  # rank 1 never arrives
    _commit(tier, tmp_path, step=20, rank=0, world_size=1)
    before = _names(admin, gcs_bucket)
    assert tier.gc_incomplete(JOB, 0, now=time.time() + 10**6, any_writer=True) == []
    assert _names(admin, gcs_bucket) == before


_UPLOADER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from strata.config import GcsTierConfig
    from strata.format.manifest import Manifest
    from strata.tiers.gcs import GcsTier

    cfg = GcsTierConfig.model_validate_json(os.environ["CFG"])
    manifest = Manifest.from_json(Path(os.environ["MANIFEST"]).read_bytes(), "MANIFEST")
    tier = GcsTier(cfg, writer_id=os.environ["WRITER"], retry_timeout=10)
    print("uploading", flush=True)
    tier.put_shard(manifest.job_id, manifest.step, manifest.rank, Path(os.environ["SRC"]), manifest)
    print("committed", flush=True)
    """
)


def test_c08_uploader_killed_mid_upload(
    gcs_emulator: GcsEmulator, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """SIGKILL a real process while it uploads a large shard: the step never looks committed
    (or, if the kill came late, it is committed and verifies); GC removes the leftovers only
    after the grace period, once a newer step is complete."""
    cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/", max_workers=2)
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=200, nbytes=24 * CHUNK)
    (tmp_path / "manifest.json").write_bytes(manifest.to_json())
    env = {
        **os.environ,
        "CFG": cfg.model_dump_json(),
        "MANIFEST": str(tmp_path / "manifest.json"),
        "SRC": str(path),
        "WRITER": WRITER,
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _UPLOADER], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        step_prefix = f"ckpt/{layout.step_key(JOB, 200)}/"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if any(True for _ in admin.list_blobs(gcs_bucket, prefix=step_prefix)):
                break
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    leftovers = {b.name for b in admin.list_blobs(gcs_bucket, prefix=step_prefix)}
    assert leftovers, "the uploader was killed before it wrote anything"

    with GcsTier(cfg, writer_id=WRITER, retry_timeout=10) as tier:
        mkey = f"ckpt/{layout.manifest_key(JOB, 200, 0)}"
        if mkey in leftovers:  # killed after the commit point: then it must be whole
            tier.fetch_shard(JOB, 200, 0, tmp_path / "late.bin")
            pytest.skip("the kill landed after the commit point on this run")
        assert 200 not in tier.complete_steps(JOB)
        _commit(tier, tmp_path, step=300, nbytes=100)
        assert tier.gc_incomplete(JOB, grace_seconds=3600) == []
        deleted = tier.gc_incomplete(JOB, grace_seconds=3600, now=time.time() + 3601)
        assert {d.removeprefix(f"gs://{gcs_bucket}/") for d in deleted} == leftovers
        assert not any(True for _ in admin.list_blobs(gcs_bucket, prefix=step_prefix))
        assert tier.complete_steps(JOB) == [300]


@pytest.mark.parametrize("nbytes", [3000, 6 * CHUNK + 99], ids=["simple", "composite"])
def test_c09_when_put_shard_returns_every_object_is_whole_and_manifest_is_last(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path, nbytes: int
) -> None:
    world = 3
    manifests = {}
    for rank in range(world):
        path, manifest, _ = make_shard(
            tmp_path, job_id=JOB, step=42, rank=rank, world_size=world, nbytes=nbytes
        )
        tier.put_shard(JOB, 42, rank, path, manifest)
        manifests[rank] = manifest
        # Checked right when put_shard returned, before any other rank is written.
        bucket = admin.bucket(gcs_bucket)
        data = bucket.get_blob(f"ckpt/{layout.data_key(JOB, 42, rank)}")
        man = bucket.get_blob(f"ckpt/{layout.manifest_key(JOB, 42, rank)}")
        assert data is not None and man is not None
        assert data.size == nbytes
        assert crc32c_of_b64(data.crc32c) == manifest.crc32c
        assert man.updated >= data.updated
        assert man.generation >= data.generation
        assert man.metadata[META_DATA_GENERATION] == str(data.generation)
        assert man.download_as_bytes() == manifest.to_json()
    assert tier.complete_steps(JOB) == [42]
    assert not [n for n in _names(admin, gcs_bucket) if PART_MARKER in n]


class _FaultProxy:
    """A loopback HTTP proxy in front of fake-gcs-server that injects network faults.

    ``forbid``: requests whose path contains it get GCS's 403 answer (IAM denies the caller).
    ``drop_first``: the first request whose path contains it is forwarded (the server applies
    it) but its response is dropped (connection closed), like a network failure after an
    upload landed. ``corrupt``: every response to a request whose path contains it has one
    byte flipped in the middle of its body, like corruption in transit; ``corrupt_request``:
    the same to the body of every request whose path contains it. ``via_proxy``: rewrite
    ``Location`` answers (resumable upload sessions) to point at the proxy. Records every
    (method, path, status) it forwarded in ``seen``.
    """

    def __init__(
        self,
        upstream: str,
        drop_first: str | None = None,
        corrupt: str | None = None,
        forbid: str | None = None,
        corrupt_request: str | None = None,
        via_proxy: bool = False,
    ):
        self.upstream = upstream.removeprefix("http://")
        self.drop_first = drop_first
        self.corrupt = corrupt
        self.forbid = forbid
        self.corrupt_request = corrupt_request
        self.via_proxy = via_proxy
        self.dropped = 0
        self.corrupted = 0
        self.seen: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.forbid is not None and proxy.forbid in self.path:
                    # What GCS answers when IAM denies the caller.
                    err = (
                        b'{"error":{"code":403,"message":"caller does not have '
                        b'storage.objects.list access","errors":[{"reason":"forbidden"}]}}'
                    )
                    self.send_response(403)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    self.wfile.write(err)
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                if (
                    proxy.corrupt_request is not None
                    and proxy.corrupt_request in self.path
                    and body
                ):
                    flipped = bytearray(body)
                    flipped[len(flipped) // 2] ^= 0x01
                    body = bytes(flipped)
                    with proxy._lock:
                        proxy.corrupted += 1
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    payload = resp.read()
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.seen.append((self.command, self.path, resp.status))
                    drop = (
                        proxy.drop_first is not None
                        and proxy.dropped == 0
                        and proxy.drop_first in self.path
                    )
                    if drop:
                        proxy.dropped += 1
                    if (
                        proxy.corrupt is not None
                        and proxy.corrupt in self.path
                        and resp.status in (200, 206)
                        and payload
                    ):
                        flipped = bytearray(payload)
                        flipped[len(flipped) // 2] ^= 0x01
                        payload = bytes(flipped)
                        proxy.corrupted += 1
                if drop:
                    self.close_connection = True
                    return  # the upstream applied it; the client never hears back
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        if proxy.via_proxy and k.lower() == "location":
                            v = v.replace(proxy.upstream, proxy.endpoint.removeprefix("http://"))
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_412_on_retry_of_an_upload_that_landed_is_success(
    gcs_emulator: GcsEmulator, gcs_bucket: str, tmp_path: Path
) -> None:
    """The data upload lands but its response is lost; the client's retry gets 412; the stored
    CRC32C matches, so put_shard goes on and commits."""
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=3, nbytes=5000)
    # The first upload put_shard makes is the data object (a simple upload names the object in
    # the request body, not the URL).
    with _FaultProxy(gcs_emulator.endpoint, drop_first="uploadType=multipart") as proxy:
        cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/", endpoint=proxy.endpoint)
        with GcsTier(cfg, writer_id=WRITER, retry_timeout=20) as tier:
            tier.put_shard(JOB, 3, 0, path, manifest)
            tier.fetch_shard(JOB, 3, 0, tmp_path / "out.bin")
    assert proxy.dropped == 1
    uploads = [status for method, p, status in proxy.seen if "uploadType=multipart" in p]
    assert uploads == [200, 412, 200]  # data, its retry, the manifest
    assert (tmp_path / "out.bin").read_bytes() == data


def test_412_with_identical_bytes_already_there_is_success(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """Re-promoting a step whose data landed before a crash (no manifest) just commits it."""
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=4, nbytes=700)
    blob = admin.bucket(gcs_bucket).blob(f"ckpt/{layout.data_key(JOB, 4, 0)}")
    blob.metadata = {META_WRITER: "pod-from-before-the-crash"}
    blob.upload_from_string(data)
    tier.put_shard(JOB, 4, 0, path, manifest)
    assert tier.complete_steps(JOB) == [4]
    # Idempotent: committing the same shard again uploads nothing.
    assert tier.put_shard(JOB, 4, 0, path, manifest) == 0


def test_412_from_another_writer_is_a_clear_conflict(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=8, nbytes=700)
    name = _leave_uncommitted(admin, gcs_bucket, 8, 0, writer="pod-b")
    theirs = admin.bucket(gcs_bucket).blob(name).download_as_bytes()
    with pytest.raises(GcsConflict, match=f"gs://{gcs_bucket}/{name}.*another writer"):
        tier.put_shard(JOB, 8, 0, path, manifest)
    assert admin.bucket(gcs_bucket).blob(name).download_as_bytes() == theirs
    assert 8 not in tier.complete_steps(JOB)


def test_own_uncommitted_leftover_is_replaced(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """An earlier attempt of this writer at the same step left other bytes without a manifest
    (e.g. training restarted and re-saved the step): it is replaced, then committed."""
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=8, nbytes=CHUNK)
    _leave_uncommitted(admin, gcs_bucket, 8, 0, writer=WRITER)
    tier.put_shard(JOB, 8, 0, path, manifest)
    tier.fetch_shard(JOB, 8, 0, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data


def test_committed_shard_is_never_overwritten(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=11, nbytes=900)
    tier.put_shard(JOB, 11, 0, path, manifest)
    other_path, other, _ = make_shard(tmp_path, job_id=JOB, step=11, nbytes=900)
    with pytest.raises(GcsConflict, match=f"gs://{gcs_bucket}/ckpt/"):
        tier.put_shard(JOB, 11, 0, other_path, other)
    tier.fetch_shard(JOB, 11, 0, tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == data
    assert tier.get_manifest(JOB, 11, 0) == manifest


def test_unreachable_endpoint_names_the_object(gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    cfg = gcs_emulator.tier_config(
        "some-bucket", prefix="ckpt", endpoint=f"http://127.0.0.1:{free_port()}"
    )
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=1)
    with GcsTier(cfg, writer_id=WRITER, retry_timeout=1.5, request_timeout=2) as tier:
        with pytest.raises(
            GcsUnreachable, match=r"gs://some-bucket/ckpt/ns\.job/steps/.*did not answer"
        ):
            tier.list_steps(JOB)
        with pytest.raises(
            GcsUnreachable,
            match=r"gs://some-bucket/ckpt/ns\.job/steps/000000000001/rank-00000\.(manifest|data)",
        ):
            tier.put_shard(JOB, 1, 0, path, manifest)


def test_missing_bucket_names_the_bucket_and_what_to_do(
    gcs_emulator: GcsEmulator, tmp_path: Path
) -> None:
    cfg = gcs_emulator.tier_config("no-such-bucket")
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=1)
    with GcsTier(cfg, writer_id=WRITER, retry_timeout=5) as tier:
        with pytest.raises(GcsBucketNotFound, match=r"gs://no-such-bucket.*Create it"):
            tier.list_steps(JOB)
        with pytest.raises(GcsBucketNotFound, match=r"gs://no-such-bucket/ns\.job/steps/"):
            tier.put_shard(JOB, 1, 0, path, manifest)
        with pytest.raises(ShardUnavailable, match=r"gs://no-such-bucket/ns\.job/steps/"):
            tier.get_manifest(JOB, 1, 0)


def test_delete_step_removes_only_that_step(
    tier: GcsTier, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    for step in (1, 2):
        for rank in (0, 1):
            _commit(tier, tmp_path, step=step, rank=rank, world_size=2, nbytes=500)
    tier.delete_step(JOB, 1, ranks=frozenset({1}))
    assert tier.list_steps(JOB)[1].committed_ranks == {0}
    tier.delete_step(JOB, 1)
    assert list(tier.list_steps(JOB)) == [2]
    assert all(f"/{layout.step_name(2)}/" in n for n in _names(admin, gcs_bucket))


@pytest.mark.parametrize("nbytes", [CHUNK, 5 * CHUNK], ids=["single-range", "parallel-ranges"])
def test_bytes_damaged_in_transit_are_caught_per_chunk_and_not_quarantined(
    gcs_emulator: GcsEmulator, gcs_bucket: str, tmp_path: Path, nbytes: int
) -> None:
    """The stored object is intact (its CRC32C matches) but the bytes arriving are not: the
    per-chunk CRC32C check names the chunk, the range is fetched again, and after the last
    attempt the error is TransferCorrupt: a ShardUnavailable (fall back), never a ShardCorrupt
    (the good stored copy must not be quarantined)."""
    path, manifest, data = make_shard(
        tmp_path, job_id=JOB, step=6, nbytes=nbytes, chunk_size=64 * 1024
    )
    with _FaultProxy(gcs_emulator.endpoint, corrupt=".data?alt=media") as proxy:
        cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/", endpoint=proxy.endpoint)
        with GcsTier(cfg, writer_id=WRITER, retry_timeout=10) as tier:
            tier.put_shard(JOB, 6, 0, path, manifest)
            tier.verify_shard(JOB, 6, 0)  # server side: intact
            with pytest.raises(
                TransferCorrupt, match=r"rank-00000\.data: CRC32C mismatch in chunk"
            ) as err:
                tier.fetch_shard(JOB, 6, 0, tmp_path / "out.bin")
            assert isinstance(err.value, ShardUnavailable)
            assert not isinstance(err.value, ShardCorrupt)
            assert proxy.corrupted >= TRANSFER_ATTEMPTS
            out = tmp_path / "unverified.bin"
            tier.fetch_shard(JOB, 6, 0, out, verify=False)
            assert out.read_bytes() != data
            assert len(out.read_bytes()) == nbytes
    with GcsTier(
        gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/"), writer_id=WRITER, retry_timeout=10
    ) as direct:
        direct.fetch_shard(JOB, 6, 0, tmp_path / "clean.bin")
    assert (tmp_path / "clean.bin").read_bytes() == data


def test_manifest_damaged_in_transit_is_unavailable_not_corrupt(
    gcs_emulator: GcsEmulator, gcs_bucket: str, tmp_path: Path
) -> None:
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=2, nbytes=100)
    with _FaultProxy(gcs_emulator.endpoint, corrupt=".manifest?alt=media") as proxy:
        cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/", endpoint=proxy.endpoint)
        with GcsTier(cfg, writer_id=WRITER, retry_timeout=10) as tier:
            tier.put_shard(JOB, 2, 0, path, manifest)
            with pytest.raises(TransferCorrupt, match=r"rank-00000\.manifest: damaged in transit"):
                tier.get_manifest(JOB, 2, 0)
    assert proxy.corrupted == TRANSFER_ATTEMPTS


def test_permission_denied_names_the_bucket_and_what_to_grant(
    gcs_emulator: GcsEmulator, gcs_bucket: str, tmp_path: Path
) -> None:
    with _FaultProxy(gcs_emulator.endpoint, forbid="/o") as proxy:  # object calls only
        cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt", endpoint=proxy.endpoint)
        with (
            GcsTier(cfg, writer_id=WRITER, retry_timeout=5) as tier,
            pytest.raises(
                GcsPermissionDenied, match=rf"gs://{gcs_bucket}/ckpt/ns\.job/steps/.*objectUser"
            ),
        ):
            tier.list_steps(JOB)
        path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=1)
        with (
            GcsTier(cfg, writer_id=WRITER, retry_timeout=5) as tier,
            pytest.raises(GcsPermissionDenied, match=rf"gs://{gcs_bucket}/ckpt/ns\.job/steps/"),
        ):
            tier.put_shard(JOB, 1, 0, path, manifest)


# -- streamed uploads (issue 14: promotion at the copy floor) ----------------------------------

STREAMED = 9 * 1024 * 1024 + 12_345
"""Over the client's 8 MiB single-request limit: streamed from the file."""


def _streaming_tier(
    gcs_emulator: GcsEmulator, gcs_bucket: str, parts: bool, endpoint: str | None = None
) -> GcsTier:
    """Production thresholds (one request up to 150 MiB), or ``parts``: 1 MiB composite parts."""
    extra: dict[str, object] = (
        {"chunk_size_bytes": 1024 * 1024, "parallel_threshold_bytes": 0}
        if parts
        else {"chunk_size_bytes": 32 * 1024 * 1024, "parallel_threshold_bytes": 150 * 1024**2}
    )
    if endpoint is not None:
        extra["endpoint"] = endpoint
    cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt/", **extra)
    return GcsTier(cfg, writer_id=WRITER, retry_timeout=10)


def test_a_shard_over_8_mib_goes_up_in_one_streamed_request_from_a_longer_slot_file(
    gcs_emulator: GcsEmulator, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=4, nbytes=STREAMED, pad=70_000)
    proxy = _FaultProxy(gcs_emulator.endpoint, via_proxy=True)
    with proxy, _streaming_tier(gcs_emulator, gcs_bucket, False, proxy.endpoint) as tier:
        assert tier.put_shard(JOB, 4, 0, path, manifest) == STREAMED
    uploads = [(m, p) for m, p, _ in proxy.seen if "/upload/" in p]
    assert [m for m, _ in uploads] == ["POST", "PUT", "POST"], uploads  # session, data, manifest
    assert _names(admin, gcs_bucket) == {
        f"ckpt/{layout.data_key(JOB, 4, 0)}",
        f"ckpt/{layout.manifest_key(JOB, 4, 0)}",
    }
    stored = admin.bucket(gcs_bucket).get_blob(f"ckpt/{layout.data_key(JOB, 4, 0)}")
    assert stored is not None and stored.size == STREAMED
    assert crc32c_of_b64(stored.crc32c) == manifest.crc32c
    assert stored.metadata[META_WRITER] == WRITER
    with _streaming_tier(gcs_emulator, gcs_bucket, False) as tier:
        tier.fetch_shard(JOB, 4, 0, tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == data


def test_a_streamed_upload_whose_answer_is_lost_is_retried_in_a_new_session(
    gcs_emulator: GcsEmulator,
    admin: storage.Client,
    gcs_bucket: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The data PUT lands but the connection drops before its answer: upload_range's retry
    (tenacity, 1 s later) opens a new session; the object is there (412), its CRC32C matches, so
    put_shard goes on and commits."""
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=7, nbytes=STREAMED)
    proxy = _FaultProxy(gcs_emulator.endpoint, drop_first="upload_id=", via_proxy=True)
    with (
        caplog.at_level(logging.INFO, logger="strata.tiers.gcs.stream"),
        proxy,
        _streaming_tier(gcs_emulator, gcs_bucket, False, proxy.endpoint) as tier,
    ):
        assert tier.put_shard(JOB, 7, 0, path, manifest) == STREAMED
    assert proxy.dropped == 1
    assert f"{layout.data_key(JOB, 7, 0)} failed" in caplog.text and "retrying" in caplog.text
    sessions = [p for m, p, _ in proxy.seen if m == "POST" and "uploadType=resumable" in p]
    assert len(sessions) >= 2, proxy.seen  # the first session's PUT, then a retry
    with _streaming_tier(gcs_emulator, gcs_bucket, False) as tier:
        tier.fetch_shard(JOB, 7, 0, tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == data


@pytest.mark.parametrize("parts", [False, True], ids=["one-request", "parts"])
def test_a_corrupt_source_is_stopped_while_it_streams_naming_the_chunk(
    gcs_emulator: GcsEmulator, admin: storage.Client, gcs_bucket: str, tmp_path: Path, parts: bool
) -> None:
    """The bytes sent are checked as they are read: the request is abandoned before the object
    is finalized (nothing stored, nothing to delete) and the error names the bad chunk."""
    path, manifest, data = make_shard(tmp_path, job_id=JOB, step=5, nbytes=STREAMED, pad=99)
    bad = bytearray(path.read_bytes())
    bad[5 * 1024 * 1024 + 3] ^= 0x10
    path.write_bytes(bytes(bad))
    chunk = (5 * 1024 * 1024 + 3) // manifest.chunk_size
    with _streaming_tier(gcs_emulator, gcs_bucket, parts) as tier:
        with pytest.raises(SourceCorrupt, match=rf"{path} does not match .* in chunk {chunk} "):
            tier.put_shard(JOB, 5, 0, path, manifest)
        assert _names(admin, gcs_bucket) == set()
        path.write_bytes(data)  # the good copy goes up
        assert tier.put_shard(JOB, 5, 0, path, manifest) == STREAMED
        tier.verify_shard(JOB, 5, 0)


def test_a_streamed_upload_damaged_in_transit_is_deleted_and_the_source_kept(
    gcs_emulator: GcsEmulator, admin: storage.Client, gcs_bucket: str, tmp_path: Path
) -> None:
    """GCS's CRC32C of what it stored differs from that of the bytes sent: the network, not the
    source (GcsUnreachable, never SourceCorrupt, so the source is not quarantined)."""
    path, manifest, _ = make_shard(tmp_path, job_id=JOB, step=6, nbytes=STREAMED)
    proxy = _FaultProxy(gcs_emulator.endpoint, corrupt_request="upload_id=", via_proxy=True)
    with (
        proxy,
        _streaming_tier(gcs_emulator, gcs_bucket, False, proxy.endpoint) as tier,
        pytest.raises(GcsUnreachable, match="corrupted in transit") as err,
    ):
        tier.put_shard(JOB, 6, 0, path, manifest)
    assert not isinstance(err.value, ShardCorrupt)
    assert proxy.corrupted >= 1
    assert _names(admin, gcs_bucket) == set()


def test_range_crc32c_reads_a_range_in_bounded_blocks(tmp_path: Path) -> None:
    """What a 412 on a retried part is checked against: the CRC32C of the part's byte range,
    read in 1 MiB blocks (never the whole part in memory)."""
    from strata.format import crc
    from strata.tiers.gcs.stream import BLOCK_BYTES, range_crc32c

    data = os.urandom(3 * BLOCK_BYTES + 777)
    path = tmp_path / "src"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in [(0, len(data)), (5, BLOCK_BYTES), (BLOCK_BYTES - 1, 2 * BLOCK_BYTES + 9)]:
            assert range_crc32c(fd, off, n) == crc.crc32c(data[off : off + n])
        with pytest.raises(EOFError, match="ends at byte"):
            range_crc32c(fd, len(data) - 10, 20)
    finally:
        os.close(fd)
