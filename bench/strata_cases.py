"""Strata's side of every comparison, through its public client and tier APIs only."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.harness import Measure

JOB = "bench.strata"


def unavailable() -> str | None:
    """None when Strata's client and tiers import; else why not (the case is reported as missing)."""
    try:
        import strata.client
        import strata.tiers.posix  # noqa: F401
    except Exception as exc:  # any import problem means "not measurable", reported as such
        return f"{type(exc).__name__}: {exc}"
    return None


def gcs_unavailable() -> str | None:
    try:
        import strata.testing.emulator
        import strata.tiers.gcs  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return unavailable()


class StrataSaver:
    """A :class:`strata.Checkpointer` (rank 0 of 1) on a RAM tier directory of its own.

    ``keep=1``: the default ring of two slots. Each :meth:`save` is a new step. RAM reuse of
    unchanged bytes (:mod:`strata.client.reuse`) is off: the workloads do not change between
    saves, while training changes every parameter each step, so with it on a save would leave
    nearly everything in place and the save groups would not measure the copy (reuse is
    measured by ``bench/incremental.py``).
    """

    def __init__(self, ram_dir: Path, threads: int, keep: int = 1) -> None:
        from strata.client import Checkpointer

        self.ram_dir = ram_dir
        self.slots = keep + 1
        self.step = 0
        self.ck = Checkpointer(
            job_id=JOB,
            ram_dir=ram_dir,
            keep=keep,
            rank=0,
            world_size=1,
            copy_threads=threads,
            raise_on_error=True,
        )
        self.ck.saver.reuse.enabled = False

    def save(self, state: dict[str, Any]) -> None:
        self.step += 1
        self.ck.save(self.step, state)

    def prime(self, state: dict[str, Any]) -> dict[str, float]:
        """Fill the slot ring (one save per slot) so the timed saves see the steady state.

        The first save allocates the whole ring (posix_fallocate) and every first use of a slot
        maps it with MAP_POPULATE; both are one-time costs, returned here (seconds) rather than
        mixed into the per-save stall.
        """
        out: dict[str, float] = {}
        for i in range(self.slots):
            t0 = time.perf_counter()
            self.save(state)
            out[f"prime_save_{i + 1}_s"] = time.perf_counter() - t0
            self.wait_committed()
        return out

    def wait_committed(self) -> None:
        """Until the background checksum pass has rewritten the manifest (promotable)."""
        self.ck.wait()

    def committed_shard(self) -> tuple[Path, Path]:
        """(data, manifest) paths of the newest committed step in the RAM tier."""
        self.ck.wait()
        ram = self.ck.ram
        return ram.data_path(JOB, self.step, 0), ram.manifest_path(JOB, self.step, 0)

    def restore(self, state: dict[str, Any]) -> Measure:
        """``Checkpointer.restore``: inventory, RAM hit verified (every byte), load in place."""
        t0 = time.perf_counter()
        res = self.ck.restore(state)
        seconds = time.perf_counter() - t0
        if res.tier != "ram" or res.step != self.step:
            raise RuntimeError(
                f"restored step {res.step} from {res.tier}, expected RAM {self.step}"
            )
        return {"seconds": seconds}

    def close(self) -> None:
        self.ck.close()


class PvcRestore:
    """A fresh client (empty RAM tier, as after a pod rescheduled elsewhere) restoring from
    the PVC directory: loaded where it lies, verified on the way (the default,
    ``restore.load_in_place``), or with ``load_in_place=False`` staged (verified copy into a
    new RAM slot) then loaded from RAM."""

    def __init__(
        self, ram_dir: Path, pvc_root: Path, threads: int, load_in_place: bool = True
    ) -> None:
        self.ram_dir = ram_dir
        self.pvc_root = pvc_root
        self.threads = threads
        self.load_in_place = load_in_place
        self.ck: Any = None

    def setup(self) -> None:
        from strata.client import Checkpointer
        from strata.config import RestoreConfig, StrataConfig

        shutil.rmtree(self.ram_dir, ignore_errors=True)
        self.ck = Checkpointer(
            StrataConfig(job_id=JOB, restore=RestoreConfig(load_in_place=self.load_in_place)),
            job_id=JOB,
            ram_dir=self.ram_dir,
            pvc_dir=self.pvc_root,
            rank=0,
            world_size=1,
            copy_threads=self.threads,
            raise_on_error=True,
        )

    def run(self, state: dict[str, Any]) -> Measure:
        t0 = time.perf_counter()
        res = self.ck.restore(state)
        seconds = time.perf_counter() - t0
        if res.tier != "pvc":
            raise RuntimeError(f"restored from {res.tier}, expected the PVC")
        return {"seconds": seconds}

    def teardown(self) -> None:
        if self.ck is not None:
            self.ck.close()
            self.ck = None
        shutil.rmtree(self.ram_dir, ignore_errors=True)


def promote_once(ram_root: Path, dst_root: Path) -> int:
    """Promote the newest committed RAM step to a PVC directory with the sidecar's own engine.

    :class:`strata.sidecar.promotion.PromotionEngine` ``promote_once(force_tier="pvc")``: lease the RAM
    slot, ``PosixTier.put_shard`` (check the source's CRC32Cs, copy, fsync, manifest last, fsync
    the directory), then verify the committed copy. Returns bytes promoted; raises when the
    engine reports a failure.
    """
    from strata.config import Interval, PvcTierConfig, RamTierConfig, StrataConfig
    from strata.sidecar.promotion import PromotionEngine
    from strata.tiers.posix import PosixTier
    from strata.tiers.ram import RamTier

    config = StrataConfig(
        job_id=JOB,
        ram=RamTierConfig(path=str(ram_root)),
        pvc=PvcTierConfig(path=str(dst_root), every=Interval(steps=1)),
        writer_id="bench",
    )
    ram = RamTier(ram_root)
    engine = PromotionEngine(config, ram, {"pvc": PosixTier(dst_root, "pvc")}, local_ranks=[0])
    result = engine.promote_once(force_tier="pvc")
    if "pvc" not in result.promoted:
        raise RuntimeError(f"promotion to the PVC failed: {result.failed or 'nothing to promote'}")
    return sum(p.stat().st_size for p in dst_root.rglob("*.data"))


def put_shard_once(src_data: Path, src_manifest: Path, dst_root: Path) -> None:
    """The PVC tier's commit alone (no lease, no verification of the copy): a breakdown."""
    from strata.tiers.posix import PosixTier

    m = _manifest(src_manifest)
    PosixTier(dst_root, "pvc").put_shard(m.job_id, m.step, m.rank, src_data, m)


class GcsBench:
    """fake-gcs-server (memory backend) plus the plain client, transfer_manager and Strata's tier.

    The baselines upload an exact-length copy of the shard's bytes (a RAM slot file may be
    longer than its shard); Strata uploads from the committed RAM file itself.
    """

    BUCKET = "strata-bench"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.dl = workdir / "download.bin"

    def __enter__(self) -> GcsBench:
        from strata.config import GcsTierConfig
        from strata.testing.emulator import FakeGcsServer
        from strata.tiers.gcs import GcsTier

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server = FakeGcsServer().start()
        self.client = self.server.client()
        self.bucket = self.client.create_bucket(self.BUCKET)
        cfg = GcsTierConfig(bucket=self.BUCKET, endpoint=self.server.endpoint)
        self.tier = GcsTier(cfg, writer_id="bench")
        self.chunk = cfg.chunk_size_bytes
        self.workers = cfg.max_workers
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.tier.close()
        self.client.close()
        self.server.stop()

    def exact_copy(self, src: Path, nbytes: int) -> Path:
        out = self.workdir / "shard-exact.bin"
        with open(src, "rb") as fin, open(out, "wb") as fout:
            fout.write(fin.read(nbytes))
        return out

    def clear(self) -> None:
        for blob in list(self.client.list_blobs(self.BUCKET)):
            blob.delete()

    def clear_dl(self) -> None:
        self.dl.unlink(missing_ok=True)

    def plain_upload(self, exact: Path) -> Measure:
        t0 = time.perf_counter()
        self.bucket.blob("plain/shard.data").upload_from_filename(str(exact), checksum="crc32c")
        return {"seconds": time.perf_counter() - t0}

    def tm_upload(self, exact: Path) -> Measure:
        from google.cloud.storage import transfer_manager as tm

        # upload_chunks_concurrently (XML multipart) is not implemented by fake-gcs-server,
        # so the transfer_manager baseline is upload_many (one stream per file, threads).
        t0 = time.perf_counter()
        tm.upload_many_from_filenames(
            self.bucket,
            [exact.name],
            source_directory=str(exact.parent),
            blob_name_prefix="tm/",
            worker_type=tm.THREAD,
            max_workers=self.workers,
            raise_exception=True,
        )
        return {"seconds": time.perf_counter() - t0}

    def strata_put(self, data: Path, manifest_path: Path) -> Measure:
        m = _manifest(manifest_path)
        t0 = time.perf_counter()
        self.tier.put_shard(m.job_id, m.step, m.rank, data, m)
        return {"seconds": time.perf_counter() - t0}

    def plain_download(self) -> Measure:
        t0 = time.perf_counter()
        self.bucket.blob("plain/shard.data").download_to_filename(str(self.dl), checksum="crc32c")
        return {"seconds": time.perf_counter() - t0}

    def tm_download(self) -> Measure:
        from google.cloud.storage import transfer_manager as tm

        t0 = time.perf_counter()
        tm.download_chunks_concurrently(
            self.bucket.blob("plain/shard.data"),
            str(self.dl),
            chunk_size=self.chunk,
            worker_type=tm.THREAD,
            max_workers=self.workers,
            crc32c_checksum=True,
        )
        return {"seconds": time.perf_counter() - t0}

    def strata_fetch(self, manifest_path: Path) -> Measure:
        m = _manifest(manifest_path)
        t0 = time.perf_counter()
        self.tier.fetch_shard(m.job_id, m.step, m.rank, self.dl, verify=True)
        return {"seconds": time.perf_counter() - t0}


def _manifest(path: Path) -> Any:
    from strata.format.manifest import Manifest

    return Manifest.from_json(path.read_bytes(), str(path))


def data_nbytes(manifest_path: Path) -> int:
    """Meaningful length of a committed shard's data object (a slot file may be longer)."""
    return int(_manifest(manifest_path).data_nbytes)
