"""The ``strata`` console script.

``strata sidecar``
    The checkpoint sidecar (promotion, retention, restore staging, metrics, reports); configured
    only by the environment the webhook injects (:class:`strata.config.StrataConfig`; ``strata
    sidecar --help`` lists every variable and field with its default,
    :mod:`strata.cli.config_help`). Exit status 2 on invalid configuration, with a message
    naming the setting.
``strata janitor --root DIR [--grace-seconds S] [--interval-seconds S | --once]``
    Remove RAM-tier data of jobs on this node whose heartbeat is older than the grace
    (hostPath medium; run as a DaemonSet).
``strata operator ...``
    The control plane (kopf operator); imported dynamically so the data plane never imports it.
``strata version``
    Print the version.

Operator's tools on tier locations (no cluster needed; :mod:`strata.cli.tools`):
``strata list``, ``strata plan``, ``strata verify``, ``strata inspect``, ``strata export``;
``strata <command> --help`` describes each and the exit codes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from strata.cli.tools import EXIT_CODES

    parser = argparse.ArgumentParser(
        prog="strata",
        description="Multi-tier checkpointing for PyTorch",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from strata.cli.config_help import sidecar_help

    side = sub.add_parser(
        "sidecar",
        help="run the checkpoint sidecar (configured by environment)",
        description="The checkpoint sidecar: promotion RAM -> PVC -> GCS, retention, restore "
        "staging, SIGTERM flush, /metrics, reports. Exit status 2 on an invalid configuration.",
        epilog=sidecar_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    side.add_argument("--log-level", default="INFO")
    jan = sub.add_parser("janitor", help="remove RAM-tier data of jobs that no longer run")
    jan.add_argument("--root", required=True, type=Path, help="the node's RAM-tier directory")
    jan.add_argument("--grace-seconds", type=float, default=3600.0)
    jan.add_argument("--interval-seconds", type=float, default=300.0)
    jan.add_argument("--once", action="store_true", help="sweep once and exit")
    jan.add_argument("--log-level", default="INFO")
    op = sub.add_parser("operator", help="run the Strata operator", add_help=False)
    op.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("version", help="print the version")
    from strata.cli.tools import add_tool_parsers

    add_tool_parsers(sub)
    return parser


def _janitor(args: argparse.Namespace) -> int:
    from strata.sidecar.janitor import sweep
    from strata.sidecar.logs import setup_logging

    setup_logging(args.log_level)
    if args.grace_seconds < 0:
        print("strata janitor: --grace-seconds must be >= 0", file=sys.stderr)
        return 2
    while True:
        result = sweep(args.root, args.grace_seconds)
        print(
            f"janitor: removed {result.removed}, kept {len(result.kept)}, "
            f"left alone {len(result.skipped)} non-Strata directories",
            file=sys.stderr,
        )
        if args.once:
            return 0
        time.sleep(args.interval_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["operator"]:
        # Dynamic on purpose: the data plane never imports the control plane statically.
        module = importlib.import_module("strata_operator.main")
        return int(module.run(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    if args.command == "version":
        from strata import __version__

        print(f"strata {__version__}")
        return 0
    if args.command == "janitor":
        return _janitor(args)
    if args.command == "sidecar":
        from strata.sidecar.main import run_sidecar

        return run_sidecar(log_level=args.log_level)
    from strata.cli.tools import run_tool

    return run_tool(args)
