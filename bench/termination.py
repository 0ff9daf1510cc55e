"""Time from SIGTERM to a durable step, per GiB: a real trainer process and a real ``strata
sidecar`` process (the ``tests.integration.test_termination`` set-up), SIGTERM the trainer as a
kubelet does, and time until the newest RAM step is complete on the PVC directory.

``python -m bench.termination [--mib 256 512] [--modes poll ignore] [--repeat 2] [--pvc DIR]``

Side by side: the same bytes copied tmpfs -> the PVC directory with ``sendfile`` + ``fsync``
(:func:`bench.baselines.sendfile_fsync`, the floor of any flush). ``poll``: the loop polls
``ckpt.should_stop`` (a final save of the current step, then its flush); ``ignore``: it never
does (the newest committed RAM step is flushed). Figures are printed and written to
``bench/results/termination.json``; RAM use is about 3 x the state size on /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.baselines import sendfile_fsync
from strata.tiers.posix import PosixTier

GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "termination.json"


def one_run(mib: int, mode: str, pvc_root: Path) -> dict[str, Any]:
    from tests.fixtures.sidecar import REPO, SidecarProcess
    from tests.fixtures.tmpfs import SHM
    from tests.integration.test_termination import JOB, Trainer, config_for

    ram = SHM / f"strata-bench-term-{uuid.uuid4().hex[:8]}"
    ram.mkdir()
    work = Path(tempfile.mkdtemp(prefix="strata-bench-term-"))
    pvc = pvc_root / f"pvc-{uuid.uuid4().hex[:8]}"
    side = trainer = None
    try:
        config = config_for(ram, pvc)
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        env.update(config.to_env())
        log_path = work / "sidecar.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "strata.cli", "sidecar"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        side = SidecarProcess(config, proc, log_path)
        side.wait_ready(120)
        trainer = Trainer(config, mode, work / "trainer.log", mib=mib)
        trainer.wait_saved(2, timeout=600)
        t0 = time.monotonic()
        code, exit_s = trainer.terminate(timeout=config.termination_grace_seconds)
        target = max(trainer.saved())
        final = [line.split() for line in trainer.lines() if line.startswith("final ")]
        if final:
            target = int(final[0][1])
        tier = PosixTier(pvc)
        deadline = t0 + config.termination_grace_seconds
        while max(tier.complete_steps(JOB), default=-1) < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"step {target} not durable within the grace period")
            time.sleep(0.01)
        durable_s = time.monotonic() - t0
        side.terminate(timeout=config.termination_grace_seconds)
        passes = [e for e in side.log_events() if e.get("event") == "flush"]
        # The floor: the same bytes, tmpfs -> the PVC directory, one sendfile + fsync.
        shard = next((ram / JOB).rglob("*.data"))
        floor_dir = pvc_root / f"floor-{uuid.uuid4().hex[:8]}"
        floor_dir.mkdir()
        floor = sendfile_fsync(shard, floor_dir / "x.data")
        floor_s = floor["seconds"]
        shutil.rmtree(floor_dir, ignore_errors=True)
        return {
            "mib": mib,
            "mode": mode,
            "exit_code": code,
            "trainer_exit_s": round(exit_s, 3),
            "durable_s": round(durable_s, 3),
            "durable_s_per_gib": round(durable_s / (mib * 2**20 / GIB), 3),
            "flush_pass_s": [e.get("seconds") for e in passes],
            "floor_sendfile_fsync_s": round(floor_s, 3),
            "ratio_to_floor": round(durable_s / floor_s, 2) if floor_s > 0 else None,
        }
    finally:
        if trainer is not None:
            trainer.kill()
        if side is not None:
            side.kill()
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(pvc, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--modes", nargs="+", default=["poll", "ignore"], choices=["poll", "ignore"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--pvc", type=Path, default=None, help="PVC-like directory (default: /tmp)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    pvc_root = args.pvc or Path(tempfile.mkdtemp(prefix="strata-bench-term-pvc-"))
    pvc_root.mkdir(parents=True, exist_ok=True)
    rows = []
    print(
        f"{'MiB':>5} {'mode':>7} {'exit s':>7} {'durable s':>10} {'s/GiB':>7} {'floor s':>8} "
        f"{'x floor':>8}"
    )
    for mib in args.mib:
        for mode in args.modes:
            for _ in range(args.repeat):
                r = one_run(mib, mode, pvc_root)
                rows.append(r)
                print(
                    f"{mib:>5} {mode:>7} {r['trainer_exit_s']:>7.2f} {r['durable_s']:>10.2f} "
                    f"{r['durable_s_per_gib']:>7.2f} {r['floor_sendfile_fsync_s']:>8.2f} "
                    f"{r['ratio_to_floor'] or 0:>8.2f}",
                    flush=True,
                )
    if args.pvc is None:
        shutil.rmtree(pvc_root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": rows, "time": time.time()}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
