"""Sharded workload bench (issue 13): ``python -m bench.sharded [--ranks 4] [--mb 256]``.

A state of DTensors over ``--ranks`` CPU ranks (gloo): ~75% of the bytes sharded on dim 0
(FSDP-like), ~25% replicated (a replicated tensor is one chunk held by every rank). Measured, in
real processes, on the same seeded bytes:

- ``stall_over_memcpy`` per rank: median ``Checkpointer.save()`` stall / the fastest
  ``Tensor.copy_`` of that rank's stored bytes into a pre-faulted /dev/shm mapping;
- ``durable_bytes`` vs ``dcp_bytes``: bytes of one step (all ranks' data objects) vs the files
  ``dcp.save`` (FileSystemWriter) writes for the same state, and the state's unique bytes;
- ``reshard_restore_s`` vs ``dcp_load_s``: restoring the 4-rank step at half the ranks (from a
  PVC directory on /dev/shm) vs ``dcp.load`` of the DCP checkpoint at the same half size
  (slowest rank of each); ``grow_*`` the same at twice the ranks (``--no-grow`` skips it);
- ``reshard_read_over_needed`` / ``grow_read_over_needed`` per rank: bytes the restore read from
  the tiers (whole 128 KiB sub-chunks, or 4 MiB chunks where a manifest has no sub-chunk CRCs)
  over the bytes of that rank's slices (goal <= 1.1). These byte counts do not depend on the
  machine's load; the timings do.

Writes ``bench/results/sharded.json`` and prints a small table. Figures depend on the machine's
load: run it on an idle machine for numbers to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
JOB = "bench.sharded"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(mode: str, root: Path, mb: int, rounds: int) -> dict[str, Any]:
    import mmap

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import strata

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n = 16
    elems = mb * 1024 * 1024 // 4 // n
    rows = 1024
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {}
    for i in range(n):
        t = torch.randn(rows, elems // rows, generator=g) if mode == "save" else None
        place = [Replicate()] if i % 4 == 3 else [Shard(0)]
        if t is None:
            t = torch.zeros(rows, elems // rows)
        state[f"w{i}"] = distribute_tensor(t, mesh, place)
    out: dict[str, Any] = {"rank": rank}
    ram = root / "ram" / f"node-{rank}"
    pvc = root / "pvc"
    if mode == "save":
        ckpt = strata.Checkpointer(job_id=JOB, ram_dir=ram, keep=2, allow_fresh_start=True)
        stalls = []
        for step in range(rounds + 1):
            assert ckpt.save(step, {"model": state}), ckpt.last_error
            ckpt.wait()
            stalls.append(ckpt.last_stall_seconds or 0.0)
        m = ckpt.ram.get_manifest(JOB, rounds, rank)
        mine = m.data_nbytes
        # memcpy floor: copy this rank's stored chunks into a pre-faulted tmpfs mapping
        srcs = [state[e.path.split("'")[3]].to_local() for e in m.sharded if e.tensor is not None]
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
            f.truncate(max(mine, 1))
            mm = mmap.mmap(f.fileno(), max(mine, 1))
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            dst.fill_(0)
            copies = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                off = 0
                for s in srcs:
                    b = s.numel() * s.element_size()
                    dst[off : off + b].copy_(s.view(-1).view(torch.uint8))
                    off += b
                copies.append(time.perf_counter() - t0)
            del dst
            mm.close()
        out.update(stall_s=statistics.median(stalls[1:]), memcpy_s=min(copies), bytes=mine)
        # durable step: promote this rank's shard to the PVC directory (what the sidecar does)
        from strata.tiers.posix import PosixTier
        from strata.tiers.slots import SlotLease

        with SlotLease(ckpt.ram, JOB, rounds, rank) as lease:
            assert lease.manifest is not None
            PosixTier(pvc).put_shard(JOB, rounds, rank, lease.path, lease.manifest)
        ckpt.close()
        dist.barrier()
        if rank == 0:  # the step's global commit record, written last (the sidecar's committer)
            from strata.tiers.records import commit_if_complete

            assert commit_if_complete(PosixTier(pvc), JOB, rounds, "bench") is not None
        dcp.save({"model": state}, checkpoint_id=str(root / "dcp"))
    else:
        ckpt = strata.Checkpointer(
            job_id=JOB, ram_dir=ram, pvc_dir=pvc, allow_fresh_start=True
        )  # resharding is the default: the state is DTensors only
        dist.barrier()
        t0 = time.perf_counter()
        res = ckpt.restore({"model": state})
        out["reshard_restore_s"] = time.perf_counter() - t0
        out["restored_step"] = res.step
        # bytes read from the tiers (whole checksummed pieces) vs this rank's slices of the state
        out["read_bytes"] = res.nbytes
        out["needed_bytes"] = sum(t.to_local().numel() * t.element_size() for t in state.values())
        ckpt.close()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load({"model": state}, checkpoint_id=str(root / "dcp"))
        out["dcp_load_s"] = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    return out


def launch(mode: str, world: int, root: Path, mb: int, rounds: int) -> list[dict[str, Any]]:
    port = _port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(r),
            WORLD_SIZE=str(world),
            OMP_NUM_THREADS="1",
        )
        env.pop("STRATA_CONFIG", None)
        cmd = [sys.executable, "-m", "bench.sharded", "--_rank", mode, "--root", str(root)]
        cmd += ["--mb", str(mb), "--rounds", str(rounds)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode:
            raise SystemExit(f"a {mode} rank failed ({p.returncode})")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=int, default=256, help="global state size, MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--no-grow",
        dest="grow",
        action="store_false",
        help="skip the restore at twice the ranks (it runs 2 x --ranks processes)",
    )
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "sharded.json")
    a = ap.parse_args(argv)
    if a._rank:
        print(json.dumps(rank_main(a._rank, a.root, a.mb, a.rounds)))
        return 0
    root = Path(tempfile.mkdtemp(prefix="strata-bench-sharded-", dir="/dev/shm"))
    try:
        saved = launch("save", a.ranks, root, a.mb, a.rounds)
        loaded = launch("load", a.ranks // 2, root, a.mb, a.rounds)
        grown = launch("load", a.ranks * 2, root, a.mb, a.rounds) if a.grow else []
        dcp_bytes = sum(f.stat().st_size for f in (root / "dcp").iterdir() if f.is_file())
        unique = a.mb * 1024 * 1024 // 16 * 16
        result = {
            "ranks": a.ranks,
            "state_mib": a.mb,
            "unique_bytes": unique,
            "per_rank": saved,
            "stall_over_memcpy": [s["stall_s"] / s["memcpy_s"] for s in saved],
            "durable_bytes": sum(s["bytes"] for s in saved),
            "dcp_bytes": dcp_bytes,
            "reshard_to": a.ranks // 2,
            "reshard_restore_s": max(x["reshard_restore_s"] for x in loaded),
            "dcp_load_s": max(x["dcp_load_s"] for x in loaded),
            "restored_step": loaded[0]["restored_step"],
            "reshard_read_over_needed": [x["read_bytes"] / x["needed_bytes"] for x in loaded],
        }
        if grown:
            result["grow_to"] = a.ranks * 2
            result["grow_restore_s"] = max(x["reshard_restore_s"] for x in grown)
            result["grow_dcp_load_s"] = max(x["dcp_load_s"] for x in grown)
            result["grow_read_over_needed"] = [x["read_bytes"] / x["needed_bytes"] for x in grown]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(f"{'rank':>4} {'stall s':>9} {'memcpy s':>9} {'ratio':>6} {'bytes':>12}")
    for s, ratio in zip(saved, result["stall_over_memcpy"], strict=True):
        print(
            f"{s['rank']:>4} {s['stall_s']:>9.4f} {s['memcpy_s']:>9.4f} {ratio:>6.2f} {s['bytes']:>12}"
        )
    print(
        f"durable step {result['durable_bytes']} B, dcp.save {dcp_bytes} B, unique {unique} B; "
        f"restore {a.ranks}->{a.ranks // 2}: strata {result['reshard_restore_s']:.3f} s, "
        f"dcp.load {result['dcp_load_s']:.3f} s"
    )
    for key, to in (("reshard", a.ranks // 2), ("grow", a.ranks * 2)):
        ratios = result.get(f"{key}_read_over_needed")
        if ratios:
            worst = max(ratios)
            print(
                f"restore {a.ranks}->{to}: bytes read / bytes needed per rank "
                f"{' '.join(f'{x:.2f}' for x in ratios)} (worst {worst:.2f}, goal <= 1.1)"
            )
    if grown:
        print(
            f"restore {a.ranks}->{a.ranks * 2}: strata {result['grow_restore_s']:.3f} s, "
            f"dcp.load {result['grow_dcp_load_s']:.3f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
