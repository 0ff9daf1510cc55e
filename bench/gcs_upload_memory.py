"""Private memory of a process uploading one shard to GCS (issue 11, failure 6).

Uploads shards of the given sizes (GiB) from tmpfs to a fake-gcs-server (filesystem backend)
with the GCS tier's production settings (``chunk_size_bytes`` 32 MiB, ``max_workers`` 8), each
from a fresh child process, and samples the child's ``RssAnon`` (private anonymous memory,
``/proc/<pid>/status``) every 10 ms: the figure the sidecar's memory limit is charged for
besides the RAM tier's tmpfs pages. Prints one JSON line per size and writes them to ``--out``.

    python -m bench.gcs_upload_memory --sizes 0.25,1,2 --out bench/results/gcs_upload_memory.json

Run it with ``PYTHONPATH`` pointing at another checkout's ``sidecar/`` to measure that code
(the "before" figures were taken that way against the previous main). The child calls
``strata.sidecar.main.bound_heap`` when it exists, as the sidecar process does at start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

_CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from strata.config import GcsTierConfig
    from strata.format.manifest import Manifest
    from strata.tiers.gcs import GcsTier
    try:
        from strata.sidecar.main import bound_heap  # what the sidecar process does at start
        bound_heap()
    except ImportError:
        pass  # code from before issue 11
    cfg = GcsTierConfig.model_validate_json(os.environ["CFG"])
    m = Manifest.from_json(Path(os.environ["MANIFEST"]).read_bytes(), "MANIFEST")
    tier = GcsTier(cfg, writer_id="bench", retry_timeout=900, request_timeout=900)
    print("ready", flush=True)
    sys.stdin.readline()
    tier.put_shard(m.job_id, m.step, m.rank, Path(os.environ["SRC"]), m)
    print("done", flush=True)
    """
)


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def make_shard(directory: Path, nbytes: int, step: int) -> tuple[Path, Path]:
    from strata.format import crc
    from strata.format.manifest import Manifest, StorageEntry

    path = directory / f"shard-{step}.bin"
    block = os.urandom(64 * 1024 * 1024)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
    chunk = 4 * 1024 * 1024
    crcs, whole = crc.file_chunk_crcs(path, nbytes, chunk)
    m = Manifest(
        job_id="bench.upload",
        step=step,
        rank=0,
        world_size=1,
        writer_id="bench",
        tree={},
        tensors=[],
        storages=[StorageEntry(offset=0, nbytes=nbytes)],
        data_nbytes=nbytes,
        chunk_size=chunk,
        chunk_crc32c=crcs,
        crc32c=whole,
    )
    mpath = directory / f"shard-{step}.manifest"
    mpath.write_bytes(m.to_json())
    return path, mpath


def measure(endpoint: str, bucket: str, gib: float, step: int, shm: Path) -> dict[str, float]:
    from strata.config import GcsTierConfig

    nbytes = int(gib * 1024**3)
    src, mpath = make_shard(shm, nbytes, step)
    cfg = GcsTierConfig(bucket=bucket, endpoint=endpoint, prefix=f"run-{uuid.uuid4().hex[:6]}")
    env = {**os.environ, "CFG": cfg.model_dump_json(), "MANIFEST": str(mpath), "SRC": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    idle = rss_anon_kib(proc.pid)
    peak = idle
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            try:
                peak = max(peak, rss_anon_kib(proc.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.monotonic()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline().strip()
    seconds = time.monotonic() - t0
    stop.set()
    t.join()
    proc.stdin.close()
    rc = proc.wait(60)
    proc.stdout.close()
    src.unlink()
    mpath.unlink()
    if line != "done" or rc != 0:
        raise SystemExit(f"upload of {gib} GiB failed (rc {rc}, {line!r})")
    return {
        "shard_gib": gib,
        "idle_rss_anon_mib": round(idle / 1024, 1),
        "peak_rss_anon_mib": round(peak / 1024, 1),
        "upload_seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.25,1,2")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from google.cloud import storage  # noqa: F401  (fail early without the gcs extra)

    from strata.testing.emulator import FakeGcsServer

    rows = []
    with (
        FakeGcsServer(backend="filesystem") as server,
        tempfile.TemporaryDirectory(dir="/dev/shm", prefix="strata-bench-") as shm,
    ):
        client = server.client(project="test")
        bucket = f"bench-{uuid.uuid4().hex[:6]}"
        client.create_bucket(bucket)
        for i, gib in enumerate(float(x) for x in args.sizes.split(",")):
            row = measure(server.endpoint, bucket, gib, i + 1, Path(shm))
            row["label"] = args.label
            print(json.dumps(row), flush=True)
            rows.append(row)
        client.close()
    if args.out is not None:
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps(old + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
