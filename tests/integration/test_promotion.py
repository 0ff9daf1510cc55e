"""The promotion engine on real tiers: /dev/shm RAM slots, a PVC directory, fake-gcs-server."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from strata.config import StrataConfig
from strata.format import layout
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.sidecar.promotion.committer import commit_writer_rank
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.slots import LocalSlotProvider, SlotLease
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import flip_byte, write_ram_shard

pytestmark = pytest.mark.integration

JOB = "ns.train"


def make_config(
    ram: Path, pvc: Path | None, gcs: dict[str, Any] | None = None, **extra: Any
) -> StrataConfig:
    raw: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(ram), "every": {"steps": 10}, "keep": 1},
        "writer_id": "test-pod",
        "gc_grace_seconds": 0,
        **extra,
    }
    if pvc is not None:
        raw["pvc"] = {"path": str(pvc), "every": {"steps": 20}, "keep": 2}
    if gcs is not None:
        raw["gcs"] = gcs
    return StrataConfig.parse(raw)


def payload(step: int, rank: int = 0, n: int = 50_000) -> bytes:
    return (f"step={step} rank={rank};".encode() * (n // 10 + 1))[:n]


def pvc_bytes(pvc: PosixTier, step: int, rank: int = 0) -> bytes:
    m = pvc.get_manifest(JOB, step, rank)
    pvc.verify_file(pvc.data_path(JOB, step, rank), m)
    return pvc.data_path(JOB, step, rank).read_bytes()[: m.data_nbytes]


class Recorder:
    def __init__(self) -> None:
        self.events: list[PromotionEvent] = []

    def __call__(self, event: PromotionEvent) -> None:
        self.events.append(event)

    def kinds(self, kind: str) -> list[PromotionEvent]:
        return [e for e in self.events if e.kind == kind]


class PvcRig(NamedTuple):
    """RAM (real tmpfs) and a PVC directory, and an engine promoting between them."""

    ram: RamTier
    pvc: PosixTier
    engine: PromotionEngine
    events: Recorder


def pvc_rig(
    shm_dir: Path, tmp_path: Path, pvc: PosixTier | None = None, **engine_kwargs: Any
) -> PvcRig:
    """The usual set-up: :func:`make_config`, ``RamTier(keep=1)``, a PVC under ``tmp_path/pvc``
    (or ``pvc``), an engine whose events go to a :class:`Recorder`; ``engine_kwargs`` go to the
    engine."""
    config = make_config(shm_dir, tmp_path / "pvc")
    ram = RamTier(shm_dir, keep=1)
    pvc = pvc if pvc is not None else PosixTier(tmp_path / "pvc")
    events = Recorder()
    engine = PromotionEngine(config, ram, {"pvc": pvc}, on_event=events, **engine_kwargs)
    return PvcRig(ram, pvc, engine, events)


def test_intervals_retention_and_gcs_copy_from_the_pvc(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    gcs_cfg = gcs_emulator.tier_config(gcs_bucket, every={"steps": 40}, keep=1).model_dump(
        mode="json"
    )
    config = make_config(shm_dir, tmp_path / "pvc", gcs_cfg)
    ram = RamTier(shm_dir, keep=1)
    pvc = PosixTier(tmp_path / "pvc")
    gcs = GcsTier(config.gcs, writer_id="test-pod", client=gcs_emulator.client())  # type: ignore[arg-type]
    events = Recorder()
    engine = PromotionEngine(config, ram, {"pvc": pvc, "gcs": gcs}, on_event=events)
    for step in range(10, 101, 10):
        write_ram_shard(ram, JOB, step, 0, payload(step))
        engine.promote_once()
    promoted = [(e.tier, e.step) for e in events.kinds("promoted")]
    assert [s for t, s in promoted if t == "pvc"] == [20, 40, 60, 80, 100]
    assert [s for t, s in promoted if t == "gcs"] == [40, 80]
    # Retention: PVC keeps 2, GCS keeps 1; only complete steps were ever deleted.
    assert pvc.complete_steps(JOB) == [80, 100]
    assert gcs.complete_steps(JOB) == [80]
    for step in (80, 100):
        assert pvc_bytes(pvc, step) == payload(step)
    fetched = tmp_path / "from-gcs"
    gcs.fetch_shard(JOB, 80, 0, fetched)
    assert fetched.read_bytes()[: len(payload(80))] == payload(80)


def test_c05_trainer_saves_while_the_sidecar_promotes(shm_dir: Path, tmp_path: Path) -> None:
    """C-05: step N+1.. are saved while N is being promoted; the PVC copy of N is N, nothing hangs."""
    started, release = threading.Event(), threading.Event()

    class HeldPvc(PosixTier):
        """A real PVC tier whose first put_shard pauses (the engine holds N's slot lease)."""

        def put_shard(self, *args: Any, **kwargs: Any) -> int:
            if not started.is_set():
                started.set()
                assert release.wait(30)
            return super().put_shard(*args, **kwargs)

    ram, pvc, engine, _ = pvc_rig(shm_dir, tmp_path, pvc=HeldPvc(tmp_path / "pvc"))
    provider = LocalSlotProvider(ram, keep=1)
    n = 20
    write_ram_shard(ram, JOB, n, 0, payload(n), provider=provider)
    promoting = threading.Thread(target=engine.promote_once)
    promoting.start()
    assert started.wait(30)
    # The trainer keeps saving into the ring; N's slot is leased so the writer never reuses it.
    for step in (21, 22, 23, 24):
        write_ram_shard(ram, JOB, step, 0, payload(step), provider=provider)
    release.set()
    promoting.join(30)
    assert not promoting.is_alive()
    assert pvc_bytes(pvc, n) == payload(n)
    assert pvc.get_manifest(JOB, n, 0).crc32c is not None
    # The newest RAM step is intact too (the ring grew instead of tearing N).
    with SlotLease(ram, JOB, 24, 0) as lease:
        assert lease.manifest is not None
        ram.verify_file(lease.path, lease.manifest)


def test_an_io_error_abandons_the_attempt_and_a_later_round_retries_from_the_source(
    shm_dir: Path, tmp_path: Path
) -> None:
    ram, pvc, engine, events = pvc_rig(shm_dir, tmp_path, backoff_seconds=0)
    write_ram_shard(ram, JOB, 20, 0, payload(20))
    # A file where the step directory must go: mkdir fails for real (ENOTDIR / EEXIST).
    blocker = tmp_path / "pvc" / layout.step_key(JOB, 20)
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"not a directory")
    first = engine.promote_once()
    assert first.failed.get("pvc") and "pvc" not in first.promoted
    assert events.kinds("failed")[0].step == 20
    blocker.unlink()
    second = engine.promote_once()
    assert second.promoted == {"pvc": 20}
    assert pvc_bytes(pvc, 20) == payload(20)


def test_c04_a_corrupt_ram_shard_is_quarantined_not_promoted_and_not_retried(
    shm_dir: Path, tmp_path: Path
) -> None:
    ram, pvc, engine, events = pvc_rig(shm_dir, tmp_path)
    write_ram_shard(ram, JOB, 20, 0, payload(20))
    flip_byte(ram.data_path(JOB, 20, 0))
    engine.promote_once()
    engine.promote_once()
    assert [e.tier for e in events.kinds("checksum_mismatch")] == ["ram"]
    assert pvc.list_steps(JOB) == {}
    assert 20 not in ram.list_steps(JOB)  # quarantined: no longer committed, never served


def test_a_shard_without_checksums_is_sealed_by_the_sidecar_and_then_promoted(
    shm_dir: Path, tmp_path: Path
) -> None:
    """The writer died before its checksum pass: after a while the sidecar checksums it itself."""
    clock = [0.0]
    ram, pvc, engine, _ = pvc_rig(shm_dir, tmp_path, seal_after_seconds=5, clock=lambda: clock[0])
    write_ram_shard(ram, JOB, 20, 0, payload(20), verified=False)
    assert engine.promote_once().promoted == {}  # maybe its writer is still checksumming
    clock[0] = 6.0
    assert engine.promote_once().promoted == {"pvc": 20}
    assert pvc_bytes(pvc, 20) == payload(20)


def test_flush_promotes_the_newest_ram_step_although_the_interval_is_not_due(
    shm_dir: Path, tmp_path: Path
) -> None:
    ram, pvc, engine, _ = pvc_rig(shm_dir, tmp_path)
    for step in (20, 30):
        write_ram_shard(ram, JOB, step, 0, payload(step))
        engine.promote_once()
    assert pvc.complete_steps(JOB) == [20]
    write_ram_shard(ram, JOB, 35, 0, payload(35), verified=False)
    result = engine.flush(deadline=engine._clock() + 30)
    assert result.ok and result.ram_step == 35 and result.durable_step == 20
    assert pvc_bytes(pvc, 35) == payload(35)


def test_retention_gc_respects_grace_writer_and_never_deletes_the_newest_complete(
    shm_dir: Path, tmp_path: Path
) -> None:
    pvc_root = tmp_path / "pvc"
    config = make_config(shm_dir, pvc_root, gc_grace_seconds=3600)
    ram = RamTier(shm_dir, keep=1)
    pvc = PosixTier(pvc_root)
    # An interrupted promotion of ours (data, no manifest) and a step another writer committed,
    # both older than the newest complete step.
    staged = RamTier(tmp_path / "staging", keep=1)
    m10 = write_ram_shard(
        staged, JOB, 10, 0, payload(10), writer_id="other-pod/rank-0", world_size=2
    )
    pvc.put_shard(JOB, 10, 0, staged.data_path(JOB, 10, 0), m10)
    partial = pvc_root / layout.data_key(JOB, 15, 0)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"half a shard")
    now = [time.time()]
    engine = PromotionEngine(config, ram, {"pvc": pvc}, wall_clock=lambda: now[0])
    write_ram_shard(ram, JOB, 20, 0, payload(20))
    engine.promote_once()
    # Within the grace period nothing incomplete is touched.
    assert {15, 10, 20} <= set(pvc.list_steps(JOB))
    now[0] += 3601
    os.utime(partial, (now[0] - 7200, now[0] - 7200))
    engine.views.progress["pvc"].last_maintenance = None
    engine.promote_once()
    steps = pvc.list_steps(JOB)
    assert 15 not in steps  # our uncommitted leftovers: collected
    assert 0 in steps[10].committed_ranks  # another writer's committed shard: left alone
    assert pvc.complete_steps(JOB) == [20]


def test_one_sidecar_serves_several_ranks_and_promotes_only_steps_all_of_them_committed(
    shm_dir: Path, tmp_path: Path
) -> None:
    ram, pvc, engine, _ = pvc_rig(shm_dir, tmp_path)
    for rank in (0, 1):
        write_ram_shard(ram, JOB, 10, rank, payload(10, rank), world_size=2)
    write_ram_shard(ram, JOB, 20, 0, payload(20, 0), world_size=2)
    engine.promote_once()
    assert engine.local_ranks() == {0, 1}
    assert pvc.list_steps(JOB) == {}  # rank 1 has not committed step 20 yet
    write_ram_shard(ram, JOB, 20, 1, payload(20, 1), world_size=2)
    assert engine.promote_once().promoted == {"pvc": 20}
    assert pvc.complete_steps(JOB) == [20]
    assert pvc_bytes(pvc, 20, 1) == payload(20, 1)


def test_pods_at_different_steps_promote_the_same_aligned_step_so_the_pvc_step_is_complete(
    tmp_path: Path,
) -> None:
    """Two pods (one rank each, own RAM, own sidecar) look at different moments: rank 0 has
    saved up to step 80, rank 1 up to step 110. With pvc.every.steps=20 both must promote a
    multiple of 20 that both hold, never "their newest", or the PVC never holds a complete step.
    """
    pvc_root = tmp_path / "pvc"
    engines = []
    for rank, newest in ((0, 80), (1, 110)):
        ram_root = tmp_path / f"ram-{rank}"
        config = make_config(ram_root, pvc_root)
        ram = RamTier(ram_root, keep=5)
        for step in range(newest - 40, newest + 1, 10):
            write_ram_shard(ram, JOB, step, rank, payload(step, rank), world_size=2)
        engines.append(PromotionEngine(config, ram, {"pvc": PosixTier(pvc_root)}))
    for engine in engines:
        engine.promote_once()
    pvc = PosixTier(pvc_root)
    listing = pvc.list_steps(JOB)
    promoted = {step: sorted(entry.committed_ranks) for step, entry in listing.items()}
    assert all(step % 20 == 0 for step in promoted), promoted
    assert promoted[80] == [0] and promoted[100] == [1]
    # Rank 0 catches up to step 100 (its RAM now holds it): the PVC's step 100 becomes complete.
    ram0 = engines[0].ram
    for step in (90, 100):
        write_ram_shard(ram0, JOB, step, 0, payload(step, 0), world_size=2)
    engines[0].promote_once()
    assert pvc.newest_complete_step(JOB) == 100
    assert pvc_bytes(pvc, 100, 1) == payload(100, 1)
    assert pvc_bytes(pvc, 100, 0) == payload(100, 0)


class _Inotify:
    """The kernel's inotify on one directory (real file-system events, via libc)."""

    ACCESS, CLOSE_WRITE, CLOSE_NOWRITE, OPEN = 0x01, 0x08, 0x10, 0x20

    def __init__(self, directory: Path) -> None:
        import ctypes
        import ctypes.util

        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip(f"inotify unavailable: {os.strerror(ctypes.get_errno())}")
        mask = self.ACCESS | self.CLOSE_WRITE | self.CLOSE_NOWRITE | self.OPEN
        if self._libc.inotify_add_watch(self.fd, str(directory).encode(), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")

    def events(self) -> list[tuple[str, int]]:
        """(file name, event mask) of every event since the last call."""
        import struct

        out: list[tuple[str, int]] = []
        while True:
            try:
                raw = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(raw):
                _wd, mask, _cookie, n = struct.unpack_from("iIII", raw, i)
                name = raw[i + 16 : i + 16 + n].rstrip(b"\0").decode()
                out.append((name, mask))
                i += 16 + n

    def close(self) -> None:
        os.close(self.fd)


def test_a_pvc_promotion_writes_the_copy_once_and_never_reads_it_back(
    shm_dir: Path, tmp_path: Path
) -> None:
    """Issue 14 (promotion at the copy floor): the PVC tier checks the very bytes it writes, so
    the engine does not re-read the committed copy (a read-back after fsync reads the page
    cache, not the disk). The kernel's inotify shows every open of the data file."""
    ram, pvc, engine, events = pvc_rig(shm_dir, tmp_path)
    data = os.urandom(300_000)
    write_ram_shard(ram, JOB, 20, 0, data)
    step_dir = pvc.step_dir(JOB, 20)
    step_dir.mkdir(parents=True)
    watch = _Inotify(step_dir)
    try:
        assert engine.promote_once().promoted == {"pvc": 20}
        seen = [
            m for name, m in watch.events() if name == layout.shard_stem(0) + layout.DATA_SUFFIX
        ]
    finally:
        watch.close()
    assert seen, "inotify saw nothing: the watch is broken"
    assert any(m & _Inotify.CLOSE_WRITE for m in seen)
    assert not [m for m in seen if m & (_Inotify.CLOSE_NOWRITE | _Inotify.ACCESS)], seen
    kinds = [e.kind for e in events.events if e.step == 20]
    assert "promoted" in kinds and "checksum_mismatch" not in kinds, kinds
    assert pvc_bytes(pvc, 20) == data  # and the copy is right


def test_a_second_flush_of_a_step_whose_shards_it_placed_returns_at_once(tmp_path: Path) -> None:
    """Two pods' sidecars flush a 2-rank step at termination. The first pass of pod 0 places
    its shard (no commit: rank 1's is not there yet); pod 1's then places its own. Pod 0's own
    SIGTERM starts a second pass: its shard is on the PVC, so it is done at once (it used to
    retry until the deadline and report the flush as failed). Step 36's designated commit
    writer is rank 0 (:func:`commit_writer_rank`): pod 1 places its shard without the record."""
    assert commit_writer_rank(36, 2) == 0
    pvc_root = tmp_path / "pvc"
    engines = []
    for rank in (0, 1):
        ram_root = tmp_path / f"ram-{rank}"
        config = make_config(ram_root, pvc_root, writer_id=f"pod-{rank}")
        ram = RamTier(ram_root, keep=1)
        write_ram_shard(ram, JOB, 36, rank, payload(36, rank), world_size=2)
        engines.append(PromotionEngine(config, ram, {"pvc": PosixTier(pvc_root)}))
    first = engines[0].flush(deadline=engines[0]._clock() + 30)
    assert (first.ok, first.message, first.ram_step) == (True, "promoted", 36)
    assert engines[1].flush(deadline=engines[1]._clock() + 30).ok
    again = engines[0].flush(deadline=engines[0]._clock() + 3)
    assert again.ok, again
    assert again.nbytes == 0  # nothing copied twice
    assert PosixTier(pvc_root).newest_complete_step(JOB) == 36


def test_a_shard_given_up_for_want_of_space_lands_once_space_is_back(
    shm_dir: Path, small_tmpfs: Any
) -> None:
    """A real 1 MiB tmpfs as the PVC, filled to the last block: the shard fails with ENOSPC
    ``max_attempts`` times and the step is given up; once the ballast is removed and the
    backoff has passed, the step is no longer given up and the same shard is committed."""
    from strata.sidecar.promotion.copy import ShardCopier

    pvc_root = small_tmpfs(1024 * 1024)
    ballast = pvc_root / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    ram = RamTier(shm_dir, keep=2)
    m = write_ram_shard(ram, JOB, 7, 0, os.urandom(300_000))
    now = [0.0]
    events: list[PromotionEvent] = []
    copier = ShardCopier(
        JOB,
        ram,
        {"pvc": PosixTier(pvc_root / "ckpt")},
        emit=events.append,
        clock=lambda: now[0],
        lease_timeout=5.0,
        max_attempts=2,
        backoff_seconds=1.0,
    )
    for _ in range(2):
        ok, _n, msg = copier.promote_shard("pvc", 7, 0, m)
        assert not ok and "no space left on the pvc tier" in msg, msg
        now[0] += 10.0
    assert [e.kind for e in events] == ["failed", "gave_up"]
    now[0] = 10.5  # within the backoff after giving up
    assert copier.given_up("pvc") == {7}
    ballast.unlink()
    now[0] += 100.0
    assert copier.given_up("pvc") == set()
    ok, nbytes, msg = copier.promote_shard("pvc", 7, 0, m)
    assert ok and nbytes == 300_000, msg
    assert PosixTier(pvc_root / "ckpt").get_manifest(JOB, 7, 0).crc32c == m.crc32c
