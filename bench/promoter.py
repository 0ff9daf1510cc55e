"""Background promoter for the interference figure: promote one shard to a directory, in a loop.

``python -m bench.promoter --ready FILE --ram RAM_ROOT --src DATA --dst DIR [--mode M]``

``--mode strata`` runs the sidecar's own promotion engine on the newest committed RAM step
(:func:`bench.strata_cases.promote_once`); ``--mode cfr`` is a plain
in-kernel copy (``sendfile``; copy_file_range refuses tmpfs -> disk) + fsync loop.
The process touches ``FILE`` once it is ready, counts finished
promotions into ``FILE.count`` and exits on SIGTERM after the promotion in flight.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from pathlib import Path

from bench.baselines import sendfile_fsync


def _cfr_once(src: Path, dst_dir: Path) -> None:
    dst_dir.mkdir(parents=True, exist_ok=True)
    sendfile_fsync(src, dst_dir / src.name)


_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def _ioprio(klass: int, level: int) -> None:
    """ioprio_set(IOPRIO_WHO_PROCESS, self, class << 13 | level); no wrapper in ``os``."""
    import ctypes
    import platform

    nr = _SYS_IOPRIO_SET.get(platform.machine())
    if nr is not None:
        ctypes.CDLL(None, use_errno=True).syscall(nr, 1, 0, klass << 13 | level)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ready", type=Path, required=True)
    ap.add_argument("--src", type=Path, required=True, help="committed RAM shard data file")
    ap.add_argument(
        "--ram", type=Path, help="RAM tier root holding the committed step (strata mode)"
    )
    ap.add_argument("--dst", type=Path, required=True, help="PVC-like directory")
    ap.add_argument("--mode", choices=["strata", "cfr"], default="strata")
    ap.add_argument(
        "--priority",
        choices=["normal", "nice", "idle"],
        default="normal",
        help="nice: nice 19 + best-effort I/O level 7; idle: SCHED_IDLE + the idle I/O class "
        "(both allowed unprivileged, i.e. what a sidecar can ask for itself)",
    )
    args = ap.parse_args(argv)
    if args.priority == "nice":
        os.nice(19)
        _ioprio(2, 7)
    elif args.priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        _ioprio(3, 0)

    stop = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    if args.mode == "strata":
        from bench.strata_cases import promote_once

        def once() -> None:
            promote_once(args.ram, args.dst)
    else:

        def once() -> None:
            _cfr_once(args.src, args.dst)

    count = 0
    args.ready.touch()
    while not stop:
        once()
        count += 1
        args.ready.with_suffix(".count").write_text(str(count))
        # Each round starts from an empty target, like promoting a new step.
        shutil.rmtree(args.dst, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
