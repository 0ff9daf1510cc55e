"""Issue 18 figures: a LoRA-style fine-tune (a frozen base plus small adapters and their AdamW
state) saved by the real Checkpointer into a tmpfs RAM tier and promoted by the real engine to a
PVC directory and fake-gcs-server, with incremental copies on vs off.

Per save: bytes the save writes into its RAM slot (``Saver.last_copied_nbytes``: storages the
slot already holds are left in place, :mod:`strata.client.reuse`), the stall, the background
time until the step is committed and checksummed (the checksum pass, or the confirmation of the
bytes left in place), and the bytes each promotion writes to the PVC and to GCS (the engine's
``promoted`` events). Modes: ``full`` (every tier copies everything: RAM reuse and incremental
copies off), ``incremental``, ``archive`` (GCS keeps the weights only, ``components: [base,
adapters]``, each copy in full: GCS bytes per archive step). After the runs, ``confirm_vs_copy``
times, on the same state and threads, copying the frozen base into a slot against confirming it
in place (CRC32C of the live bytes and of the slot's): the price of confirming inside the stall.
Run: ``python -m bench.incremental [--base-mib 1024] [--steps 4] [--out FILE]``.
Needs fake-gcs-server (``strata.testing.emulator``) and ~4x the base size of free memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from strata import Checkpointer
from strata.client.reuse import confirm
from strata.config import StrataConfig
from strata.format import codec
from strata.format.manifest import DEFAULT_CHUNK_SIZE
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.testing.emulator import FakeGcsServer
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier

JOB = "bench.lora"
MIB = 1024 * 1024


def lora_state(base_mib: int, rank: int = 16, dim: int = 4096) -> tuple[dict[str, Any], Any]:
    """A frozen base of ``base_mib`` MiB of fp32 (dim x dim matrices) and a LoRA pair (dim x
    rank, rank x dim) per matrix, trained by AdamW; returns (state, one training step)."""
    per = dim * dim * 4
    n = max(1, base_mib * MIB // per)
    torch.manual_seed(0)
    base = [torch.randn(dim, dim) for _ in range(n)]
    adapters = torch.nn.ParameterList()
    for _ in range(n):
        adapters.append(torch.nn.Parameter(torch.randn(dim, rank) * 0.01))
        adapters.append(torch.nn.Parameter(torch.zeros(rank, dim)))
    opt = torch.optim.AdamW(adapters.parameters(), lr=1e-3)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        for p in adapters:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()

    return {"base": base, "adapters": adapters, "optim": opt, "step": 0}, step


def run(
    mode: str, base_mib: int, steps: int, root: Path, disk: Path, gcs: FakeGcsServer
) -> dict[str, Any]:
    state, train = lora_state(base_mib)
    bucket = f"bench-{mode}"
    client = gcs.client(project="bench")
    client.create_bucket(bucket)
    gcs_cfg: dict[str, Any] = {
        "bucket": bucket,
        "endpoint": gcs.endpoint,
        "every": {"steps": 10},
        "keep": 1,
    }
    if mode == "archive":  # weights only (no optimizer state), every copy in full
        gcs_cfg.update(components=["base", "adapters"], incremental=False)
    cfg = StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(root / mode / "ram"), "every": {"steps": 10}, "keep": 1},
            "pvc": {"path": str(disk / mode / "pvc"), "every": {"steps": 10}, "keep": 2},
            "gcs": gcs_cfg,
            "writer_id": "bench",
            "gc_grace_seconds": 0,
        }
    )
    ram = RamTier(Path(cfg.ram.path), keep=1)
    pvc = PosixTier(disk / mode / "pvc")
    gtier = GcsTier(cfg.gcs, writer_id="bench", client=client)  # type: ignore[arg-type]
    events: list[PromotionEvent] = []
    engine = PromotionEngine(cfg, ram, {"pvc": pvc, "gcs": gtier}, on_event=events.append)
    engine.copier.incremental = mode != "full"
    rows = []
    with Checkpointer(cfg, rank=0, world_size=1) as c:
        c.saver.reuse.enabled = mode != "full"
        for i in range(1, steps + 1):
            s = 10 * i
            train(s)
            state["step"] = s
            assert c.save(s, state), c.last_error
            stall = c.last_stall_seconds
            t0 = time.perf_counter()
            assert c.wait_copied() is not False, c.last_error
            c.wait()
            commit_s = time.perf_counter() - t0
            ram_bytes = ram.get_manifest(JOB, s, 0).data_nbytes
            ram_written = c.saver.last_copied_nbytes
            t0 = time.perf_counter()
            engine.promote_once()
            promote_s = time.perf_counter() - t0
            written = {
                t: sum(
                    e.nbytes for e in events if e.kind == "promoted" and e.step == s and e.tier == t
                )
                for t in ("pvc", "gcs")
            }
            rows.append(
                {
                    "step": s,
                    "stall_s": stall,
                    "ram_bytes": ram_bytes,
                    "ram_written": ram_written,
                    "background_s": commit_s,
                    "pvc_bytes": written["pvc"],
                    "gcs_bytes": written["gcs"],
                    "promote_s": promote_s,
                }
            )
            print(mode, rows[-1], flush=True)
    t0 = time.perf_counter()
    with Checkpointer(
        cfg.model_copy(
            update={
                "ram": cfg.ram.model_copy(update={"path": str(root / mode / "ram2")}),
                "gcs": None,
            }
        ),
        rank=0,
        world_size=1,
    ) as c2:
        res = c2.restore(state)
    restore_pvc = time.perf_counter() - t0
    gtier.close()
    later = rows[2:]  # the ring's two slots are each written in full once
    return {
        "mode": mode,
        "rows": rows,
        "restore_from_pvc_s": restore_pvc,
        "restored_step": res.step,
        "median_after_first": {
            k: statistics.median(r[k] for r in later)
            for k in (
                "stall_s",
                "ram_bytes",
                "ram_written",
                "background_s",
                "pvc_bytes",
                "gcs_bytes",
                "promote_s",
            )
        }
        if later
        else {},
    }


def confirm_vs_copy(base_mib: int, threads: int, rounds: int = 3) -> dict[str, Any]:
    """Seconds to copy the frozen base into a pre-faulted buffer vs to confirm it in place
    (:func:`strata.client.reuse.confirm`: slot CRC32Cs + the live bytes' CRC32Cs), best of
    ``rounds``, with ``threads`` threads each."""
    state, _train = lora_state(base_mib)
    enc = codec.encode(state)
    big = frozenset(i for i, e in enumerate(enc.storages) if e.nbytes >= 1 << 20)
    only = frozenset(range(len(enc.storages))) - big
    slot = torch.empty(enc.data_nbytes, dtype=torch.uint8)
    slot.fill_(0)  # pre-faulted, like a slot
    copy_s, confirm_s = [], []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(rounds):
            t0 = time.perf_counter()
            codec.write_data(enc, slot, pool, skip=only)  # the base only
            copy_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = confirm(enc, slot.data_ptr(), big, DEFAULT_CHUNK_SIZE, pool, threads)
            confirm_s.append(time.perf_counter() - t0)
            assert not res.bad
    nbytes = sum(enc.storages[i].nbytes for i in big)
    return {
        "base_bytes": nbytes,
        "threads": threads,
        "copy_s": min(copy_s),
        "confirm_s": min(confirm_s),
        "confirm_over_copy": min(confirm_s) / min(copy_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base-mib", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--modes", nargs="+", default=["full", "incremental", "archive"])
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="RAM tier (tmpfs)")
    ap.add_argument("--disk", type=Path, default=Path("/tmp"), help="PVC tier (a disk)")
    ap.add_argument("--threads", type=int, default=4, help="copy threads (confirm_vs_copy)")
    args = ap.parse_args()
    out = []
    with (
        FakeGcsServer(backend="filesystem") as gcs,
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        tempfile.TemporaryDirectory(dir=args.disk) as disk,
    ):
        for mode in args.modes:
            out.append(run(mode, args.base_mib, args.steps, Path(tmp), Path(disk), gcs))
            shutil.rmtree(Path(tmp) / mode, ignore_errors=True)
            shutil.rmtree(Path(disk) / mode, ignore_errors=True)
    doc = {
        "base_mib": args.base_mib,
        "steps": args.steps,
        "runs": out,
        "confirm_vs_copy": confirm_vs_copy(args.base_mib, args.threads),
        "load_at_end": os.getloadavg(),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
