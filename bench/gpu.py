"""The device bench (issue 14): what a checkpoint of GPU state costs, side by side in one run.

    python -m bench.gpu                      # one GPU, ~2 GB bf16 state of 147 tensors
    python -m bench.gpu --gb 8.5 --rounds 5  # the issue's H200 setting (needs ~6x that in RAM)

Every case copies the same seeded bf16 tensors on ``cuda:0`` (``--tensors`` of them, ``--gb``
in all) and runs round-robin (:mod:`bench.harness`: one unrecorded warm-up, then ``--rounds``
rounds, order rotated). Floors: device-to-host into pinned memory, into pageable memory, into a
tmpfs file mapping plain and after ``cudaHostRegister``; host-to-device from pinned memory.
Baselines: ``torch.save`` to tmpfs, ``dcp.save``, ``dcp.async_save`` (blocking part) with the
default stager and with a pinned-memory stager. Strata: ``save()`` blocking, ``save(...,
blocking=False)`` (the visible stall: until it returns), its first save after ``prepare`` (the
slot allocation done at restore), and ``restore()`` into the live GPU tensors.

Prints the table and writes ``<out>/gpu-latest.json`` (every sample, and a top-level ``ratios``
object: the keys of :data:`RATIOS`, each with its target). Without a CUDA device it measures
nothing, says so, writes nothing and exits 0 (``--require-gpu``: exit 3 instead), so CI can run
its argument parsing. The JSON's ``roundtrip`` holds a bit-exact save/restore check per kind
(:data:`KINDS`: bf16, fp32, fp8, views, non-contiguous tensors, a DTensor on a 1-rank mesh);
``--cpu-smoke`` runs only that check, on CPU tensors, GPU or not.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import Case, Measure, Result, format_table, run_round_robin

RESULTS = Path(__file__).resolve().parent / "results"
JOB = "bench.gpu"

RATIOS: dict[str, tuple[str, float]] = {
    "gpu_stall_over_pinned_d2h": ("<=", 1.1),
    "gpu_overlapped_stall_over_pinned_d2h": ("<=", 0.1),
    "gpu_first_save_over_steady": ("<=", 1.25),
    "gpu_restore_over_pinned_h2d": ("<=", 1.5),
    "gpu_speedup_vs_torch_save": (">=", 1.0),
    "gpu_speedup_vs_dcp_async_blocking": (">=", 1.0),
}
"""Ratio keys in the JSON, with the issue's targets (speedups: informative, >= 1)."""

NO_GPU = (
    "bench.gpu: no CUDA device here (torch.cuda.is_available() is False): nothing measured, "
    "nothing written. Run it on a GPU node: python -m bench.gpu [--gb N]"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; raises SystemExit(2) with argparse's message on bad input."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="state size in GB (default 2)")
    ap.add_argument("--tensors", type=int, default=147, help="tensor count (default 147)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=16, help="Strata copy threads")
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--skip-dcp", action="store_true", help="leave out dcp.save/async_save")
    ap.add_argument("--require-gpu", action="store_true", help="exit 3 without a CUDA device")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="only the bit-exact round trip, on CPU tensors (gloo mesh); exit 1 if a kind fails",
    )
    args = ap.parse_args(argv)
    if args.gb <= 0 or args.tensors < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--gb must be > 0, --tensors and --rounds >= 1, --warmup >= 0")
    return args


class _Mapping:
    """A pre-faulted tmpfs file mapping of ``nbytes`` and a uint8 CPU tensor over it."""

    def __init__(self, path: Path, nbytes: int) -> None:
        import torch

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            self.mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.path = path
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        buf = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(buf)
        del buf
        self.registered = False

    def register(self) -> None:
        import torch

        err = torch.cuda.cudart().cudaHostRegister(self.addr, len(self.mm), 1)  # portable
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        self.registered = True

    def close(self) -> None:
        import torch

        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.addr)
        del self.tensor
        self.mm.close()
        self.path.unlink(missing_ok=True)


def _d2h(tensors: list[Any], dst: Any) -> Measure:
    """Copy every tensor into ``dst`` (uint8, back to back) on a side stream; wait."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    t0 = time.perf_counter()
    off = 0
    with torch.cuda.stream(stream):
        for t in tensors:
            n = t.numel() * t.element_size()
            dst[off : off + n].copy_(t.view(-1).view(torch.uint8), non_blocking=True)
            off += n
    stream.synchronize()
    return {"seconds": time.perf_counter() - t0}


def _h2d(src: Any, tensors: list[Any]) -> Measure:
    import torch

    t0 = time.perf_counter()
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        t.view(-1).view(torch.uint8).copy_(src[off : off + n], non_blocking=True)
        off += n
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0}


def _ratio(res: dict[str, Result], a: str, b: str) -> float:
    x, y = res[a].median(), res[b].median()
    return x / y if y else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every case; returns the JSON document (also written to ``args.out``)."""
    import torch

    from bench import baselines
    from strata.client import Checkpointer

    dev = torch.device(args.device)
    per = max(1, int(args.gb * 1e9) // (2 * args.tensors))
    g = torch.Generator(device=dev).manual_seed(0)
    state = {
        f"layer{i:03d}": torch.randn(per, generator=g, device=dev, dtype=torch.float32).to(
            torch.bfloat16
        )
        for i in range(args.tensors)
    }
    tensors = list(state.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    work = args.shm_dir / f"strata-gpu-bench-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    out: dict[str, Any] = {"machine": _machine(dev), "nbytes": nbytes, "tensors": args.tensors}
    try:
        try:  # recorded, not raised: the one call on a lent GPU still measures the rest
            out["roundtrip"] = run_roundtrip(work, args.device)
        except Exception as exc:
            out["roundtrip"] = {"ok": False, "kinds": {}, "failures": [f"raised: {exc!r}"]}
        log(f"round trip: {out['roundtrip']}")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pageable.fill_(0)  # fault it in: the floor measures the copy, not first touch
        plain = _Mapping(work / "plain", nbytes)
        reg = _Mapping(work / "registered", nbytes)
        reg.register()
        ck = Checkpointer(
            job_id=JOB,
            ram_dir=work / "ram",
            rank=0,
            world_size=1,
            copy_threads=args.threads,
            raise_on_error=True,
            allow_fresh_start=True,
        )
        ck.restore(state)  # fresh start: prepares (allocates, maps, registers) the slots
        ck.wait()
        step = [0]

        def strata_save(blocking: bool) -> Measure:
            step[0] += 1
            t0 = time.perf_counter()
            ck.save(step[0], state, blocking=blocking)
            stall = time.perf_counter() - t0
            if not blocking and ck.wait_copied() is not True:
                raise RuntimeError(f"overlapped save failed: {ck.last_error}")
            return {"seconds": stall, "complete_s": time.perf_counter() - t0}

        def strata_first() -> Measure:
            # A fresh client on a fresh RAM directory: restore (fresh start) prepares the
            # slots in the background as a training job would at start-up; then the first save.
            d = work / "first"
            shutil.rmtree(d, ignore_errors=True)
            with Checkpointer(
                job_id=JOB,
                ram_dir=d,
                rank=0,
                world_size=1,
                copy_threads=args.threads,
                raise_on_error=True,
                allow_fresh_start=True,
            ) as c:
                c.restore(state)
                c.wait()
                t0 = time.perf_counter()
                c.save(1, state)
                stall = time.perf_counter() - t0
            shutil.rmtree(d, ignore_errors=True)
            return {"seconds": stall}

        def strata_restore() -> Measure:
            ck.wait()
            t0 = time.perf_counter()
            res = ck.restore(state)
            torch.cuda.synchronize()
            if res.tier != "ram":
                raise RuntimeError(f"restored from {res.tier}, expected RAM")
            return {"seconds": time.perf_counter() - t0}

        save_cases = [
            Case("d2h_pinned", lambda: _d2h(tensors, pinned), label="D2H into pinned memory"),
            Case("d2h_pageable", lambda: _d2h(tensors, pageable), label="D2H into pageable"),
            Case("d2h_tmpfs_plain", lambda: _d2h(tensors, plain.tensor), label="D2H tmpfs map"),
            Case("d2h_tmpfs_registered", lambda: _d2h(tensors, reg.tensor), label="registered"),
            Case("strata_save", lambda: strata_save(True), label="Strata save() blocking"),
            Case("strata_save_overlapped", lambda: strata_save(False), label="Strata overlapped"),
            Case("strata_first_save", strata_first, label="Strata first save after prepare"),
            Case(
                "torch_save",
                lambda: baselines.torch_save(state, work / "t.pt"),
                teardown=baselines.rm(work / "t.pt"),
            ),
        ]
        if not args.skip_dcp:
            save_cases += _dcp_cases(state, work)
        log(f"save: {nbytes / 1e9:.2f} GB in {args.tensors} bf16 tensors on {dev}")
        res = run_round_robin(save_cases, args.rounds, args.warmup, log)
        print(format_table(f"save {nbytes / 1e9:.2f} GB from {dev}", res, nbytes), flush=True)
        restore_cases = [
            Case("h2d_pinned", lambda: _h2d(pinned, tensors), label="H2D from pinned"),
            Case("strata_restore_ram", strata_restore, label="Strata restore() from RAM"),
        ]
        res2 = run_round_robin(restore_cases, args.rounds, args.warmup, log)
        print(format_table(f"restore {nbytes / 1e9:.2f} GB to {dev}", res2, nbytes), flush=True)
        ratios = {
            "gpu_stall_over_pinned_d2h": _ratio(res, "strata_save", "d2h_pinned"),
            "gpu_overlapped_stall_over_pinned_d2h": _ratio(
                res, "strata_save_overlapped", "d2h_pinned"
            ),
            "gpu_first_save_over_steady": _ratio(res, "strata_first_save", "strata_save"),
            "gpu_restore_over_pinned_h2d": _ratio(res2, "strata_restore_ram", "h2d_pinned"),
            "gpu_speedup_vs_torch_save": _ratio(res, "torch_save", "strata_save"),
            "gpu_speedup_vs_dcp_async_blocking": _ratio(res, "dcp_async_save", "strata_save")
            if "dcp_async_save" in res
            else float("nan"),
        }
        out["ratios"] = ratios
        out["targets"] = {
            k: {"op": op, "bound": b, "holds": _holds(ratios[k], op, b)}
            for k, (op, b) in RATIOS.items()
        }
        out["registered_slot_bytes"] = ck.saver.host.registered_bytes
        out["groups"] = {
            "save": {k: v.to_json() for k, v in res.items()},
            "restore": {k: v.to_json() for k, v in res2.items()},
        }
        ck.close()
        plain.close()
        reg.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-latest.json").write_text(json.dumps(out, indent=1, default=str))
    print("\nratios:")
    for k, v in out["ratios"].items():
        op, b = RATIOS[k]
        print(f"  {k:<40} {v:8.3f}  (target {op} {b}: {'holds' if _holds(v, op, b) else 'MISS'})")
    return out


KINDS = ("bf16", "fp32", "fp8_e4m3fn", "views", "non_contiguous", "dtensor")
"""The round trip's kinds, as keys of ``roundtrip`` in the JSON (fp8 only where torch has it)."""


def _init_world_of_one(work: Path, backend: str) -> bool:
    """A process group of world size 1 (``backend``: gloo or nccl) on a file store under
    ``work``, unless one exists; returns True when this call made it (the caller destroys it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store = dist.FileStore(str(work / "pg-store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return True


def roundtrip_state(place: Callable[[Any], Any], mesh: Any = None) -> dict[str, Any]:
    """A seeded state of every kind in :data:`KINDS`; ``place`` moves a CPU tensor onto the
    device under test (``t.to("cuda:0")``, a stand-in device's ``tensor``, or identity).

    Views and non-contiguous tensors are taken *after* placement, so they share the placed
    storage. ``mesh``: a 1-rank device mesh for the DTensor entry (left out when None)."""
    import torch

    g = torch.Generator().manual_seed(25)
    s: dict[str, Any] = {
        "bf16": place(torch.randn(4099, generator=g).to(torch.bfloat16)),
        "fp32": place(torch.randn(3, 1031, generator=g)),
    }
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        # every bit pattern of a byte, NaN included: a round trip must not canonicalise any
        s["fp8_e4m3fn"] = place(torch.arange(256, dtype=torch.uint8).repeat(3)).view(fp8)
    base = place(torch.randn(64, 96, generator=g))
    s["views.base"] = base
    s["views.row"] = base[7]
    s["views.cols"] = base[:, 10:50]
    s["views.flat"] = base.view(-1)[100:900]
    big = place(torch.randn(48, 80, generator=g).to(torch.bfloat16))
    s["non_contiguous.t"] = place(torch.randn(40, 72, generator=g)).t()
    s["non_contiguous.step"] = place(torch.randn(1000, generator=g))[3::7]
    s["non_contiguous.slab"] = big[::2, 5::3]
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        local = place(torch.randn(257, 33, generator=g))
        s["dtensor"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return s


def _local(t: Any) -> Any:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _bits(t: Any) -> Any:
    """The tensor's bytes in logical order, on the CPU (uint8, 1-D)."""
    import torch

    return _local(t).detach().contiguous().view(-1).view(torch.uint8).cpu()


def roundtrip(
    ram_dir: Path,
    place: Callable[[Any], Any],
    *,
    mesh: Any = None,
    blocking: tuple[bool, ...] = (True, False),
) -> dict[str, Any]:
    """Save then restore a state of every kind (:func:`roundtrip_state`) through Strata's
    :class:`~strata.client.Checkpointer` on ``ram_dir`` (a tmpfs directory, made and left for
    the caller to remove), once per ``blocking`` mode, zeroing every storage before the
    restore; returns ``{"kinds": {kind: bool}, "failures": [str], "ok": bool}``, a kind true
    when every tensor of it came back bit-identical (and views still share their base's
    storage). Raises what the Checkpointer raises (``raise_on_error=True``)."""
    import torch

    from strata.client import Checkpointer

    state = roundtrip_state(place, mesh)
    want = {k: _bits(v).clone() for k, v in state.items()}
    failures: list[str] = []
    with Checkpointer(
        job_id=JOB + ".roundtrip",
        ram_dir=ram_dir,
        rank=0,
        world_size=1,
        raise_on_error=True,
        allow_fresh_start=True,
    ) as ck:
        for step, blk in enumerate(blocking, start=1):
            ck.save(step, state, blocking=blk)
            if not blk and ck.wait_copied() is not True:
                failures.append(f"overlapped save {step}: {ck.last_error}")
            ck.wait()
            for v in state.values():
                _local(v).untyped_storage().fill_(0)
            res = ck.restore(state)
            if res.step != step:
                failures.append(f"restored step {res.step}, expected {step}")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            mode = "blocking" if blk else "overlapped"
            for k, v in state.items():
                if not torch.equal(_bits(v), want[k]):
                    failures.append(f"{k} ({mode}): bits differ after restore")
            base = state["views.base"].untyped_storage().data_ptr()
            for k in ("views.row", "views.cols", "views.flat"):
                if state[k].untyped_storage().data_ptr() != base:
                    failures.append(f"{k} ({mode}): no longer shares the base's storage")
    present = [k for k in KINDS if any(n.split(".")[0] == k for n in state)]
    kinds = {k: not any(f.split(" ")[0].split(".")[0] == k for f in failures) for k in present}
    return {"kinds": kinds, "failures": failures, "ok": not failures}


def run_roundtrip(
    work: Path, device: str, place: Callable[[Any], Any] | None = None
) -> dict[str, Any]:
    """:func:`roundtrip` on ``device`` ("cpu" or "cuda:N"), a DTensor on a 1-rank mesh
    included (nccl on CUDA, gloo on the CPU); ``work``: a tmpfs directory for the RAM tier and
    the process group's file store. ``place``: how a CPU tensor reaches the device (default
    ``t.to(device)``; a stand-in device's ``tensor`` in tests)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    made = _init_world_of_one(work, "nccl" if dev.type == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(dev.type, (1,))
        return roundtrip(work / "ram-roundtrip", place or (lambda t: t.to(dev)), mesh=mesh)
    finally:
        if made:
            dist.destroy_process_group()


def _dcp_cases(state: dict[str, Any], work: Path) -> list[Case]:
    from bench import baselines

    def async_pinned() -> Measure:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(True, False, True, True))
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fut: Any = dcp.async_save(
                state,
                storage_writer=dcp.FileSystemWriter(str(work / "dcp-pinned")),
                async_stager=stager,
                no_dist=True,
            )
            staging = getattr(fut, "staging_completion", None)
            if staging is not None:
                staging.result()
            blocking = time.perf_counter() - t0
            getattr(fut, "upload_completion", fut).result()
        stager.close()
        return {"seconds": blocking, "complete_s": time.perf_counter() - t0}

    return [
        Case(
            "dcp_save",
            lambda: baselines.dcp_save(state, work / "dcp"),
            teardown=baselines.rm(work / "dcp"),
        ),
        Case(
            "dcp_async_save",
            lambda: baselines.dcp_async_save(state, work / "dcp-async"),
            teardown=baselines.rm(work / "dcp-async"),
            label="dcp.async_save blocking part (default stager)",
        ),
        Case(
            "dcp_async_save_pinned",
            async_pinned,
            teardown=baselines.rm(work / "dcp-pinned"),
            label="dcp.async_save blocking part (pinned-memory stager)",
        ),
    ]


def _holds(v: float, op: str, bound: float) -> bool:
    return v == v and (v <= bound if op == "<=" else v >= bound)


def _machine(dev: Any) -> dict[str, Any]:
    import torch

    return {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_smoke(shm_dir: Path) -> int:
    """The round trip on CPU tensors: proves the imports and the Checkpointer work here."""
    import torch

    work = shm_dir / f"strata-gpu-smoke-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        rt = run_roundtrip(work, "cpu")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"cpu_smoke": rt, "torch": torch.__version__}, indent=1), flush=True)
    return 0 if rt["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.cpu_smoke:
        return _cpu_smoke(args.shm_dir)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 3 if args.require_gpu else 0
    out = run(args)
    return 0 if out["roundtrip"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
