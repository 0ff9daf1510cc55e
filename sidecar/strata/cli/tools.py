"""The operator's tools: ``strata list | plan | verify | inspect | export`` on tier locations.

Locations (:mod:`strata.cli.locations`): ``DIR`` (RAM when it holds slot rings, else PVC),
``ram:DIR``, ``pvc:DIR``, ``gs://BUCKET[/PREFIX]``. Output: a table (``-o table``, default) or
JSON (``-o json``, one document on stdout). Nothing here writes to a tier.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from strata.cli import output
from strata.cli.locations import NotFound, UsageError, jobs_in, opened
from strata.errors import StrataError, TierError

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_TIER = 0, 1, 2, 3, 4

EXIT_CODES = """\
exit codes (list, plan, verify, inspect, export):
  0  success (verify: every copy checked is intact)
  1  a bad copy: verify found a corrupt or unreadable copy; export found no verified copy of a shard
  2  usage error: bad arguments, a missing directory, an output directory that is not empty
  3  not found: no such job or step; plan: no step is restorable from the locations given
  4  a tier could not be read (unreachable, no credentials, permission denied)

locations: DIR (RAM tier when it holds slot rings, else PVC), ram:DIR, pvc:DIR,
gs://BUCKET[/PREFIX] (Application Default Credentials; STORAGE_EMULATOR_HOST for an emulator)
"""

TOOLS = ("list", "plan", "verify", "inspect", "export")


def _common(p: argparse.ArgumentParser, many: bool = True) -> None:
    p.add_argument(
        "locations",
        nargs="+" if many else 1,
        metavar="TIER",
        help="tier location(s): DIR, ram:DIR, pvc:DIR or gs://BUCKET/PREFIX",
    )
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")


def add_tool_parsers(sub: Any) -> None:
    """Register the tools' subparsers on the ``strata`` parser's subparsers."""

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        return p

    p = add("list", "jobs and steps per tier: complete or not, incarnation, world size, size, age")
    _common(p)
    p.add_argument("--job", help="only this job (default: every job found)")

    p = add("plan", "the step a restore would pick now and, per rank, the tier serving it")
    _common(p)
    p.add_argument("--job", required=True)
    p.add_argument(
        "--world-size", type=int, help="the job's world size (default: that of its newest step)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check each serving copy's checksums first (reads the data, as a restore would)",
    )

    p = add("verify", "re-read every copy and check every checksum (a checkpoint fsck)")
    _common(p)
    p.add_argument("--job", help="only this job (default: every job found)")
    p.add_argument("--step", type=int, help="only this step (default: every step)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = add("inspect", "the state tree of a step: keys, dtypes, shapes, sizes")
    _common(p, many=False)
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--rank", type=int, help="only this rank (default: every rank)")

    p = add("export", "write a step's global state as safetensors (+ index) or a DCP checkpoint")
    _common(p)
    p.add_argument("--job", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument(
        "--to",
        nargs=2,
        required=True,
        metavar=("FORMAT", "DIR"),
        help="safetensors or dcp, and the output directory (new or empty)",
    )
    p.add_argument(
        "--max-shard-size",
        type=int,
        default=5 * 1024**3,
        metavar="BYTES",
        help="safetensors: bytes per file at most (default 5 GiB)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_tool(args: argparse.Namespace) -> int:
    """Run a tool; errors become a message on stderr and the documented exit code."""
    try:
        return _RUN[args.command](args)
    except UsageError as exc:
        code, msg = EXIT_USAGE, str(exc)
    except NotFound as exc:
        code, msg = EXIT_NOT_FOUND, str(exc)
    except TierError as exc:
        code, msg = EXIT_TIER, str(exc)
    except StrataError as exc:
        code, msg = EXIT_BAD, str(exc)
    print(f"strata {args.command}: {msg}", file=sys.stderr)
    return code


def _list(args: argparse.Namespace) -> int:
    from strata.cli.catalog import list_rows

    with opened(args.locations) as locs:
        rows = list_rows(locs, jobs_in(locs, args.job))
    if args.job and not rows:
        raise NotFound(f"job {args.job!r}: no steps in {', '.join(args.locations)}")
    if args.output == "json":
        output.emit_json(rows)
        return EXIT_OK
    output.table(
        None,
        (
            "tier",
            "location",
            "job",
            "step",
            "complete",
            "ranks",
            "commit",
            "incarnation",
            "size",
            "age",
        ),
        [
            (
                r["tier"],
                r["location"],
                r["job"],
                r["step"],
                "yes" if r["complete"] else "no",
                f"{len(r['committed_ranks'])}/{r['world_size'] or '?'}"
                + (f" (+{len(r['partial_ranks'])} partial)" if r["partial_ranks"] else ""),
                {True: "yes", False: "no", None: "-"}[r["commit_record"]],
                r["incarnation"],
                output.human_bytes(r["bytes"]),
                output.human_age(output.age_of(r["created"])),
            )
            for r in rows
        ],
        output.stdout(),
    )
    if not rows:
        print("no checkpoints found", file=sys.stderr)
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
    from strata.cli.catalog import plan

    with opened(args.locations) as locs:
        result = plan(locs, args.job, args.world_size, verify=args.verify)
    if args.output == "json":
        output.emit_json(result.to_dict())
    else:
        con = output.stdout()
        if result.step is None:
            con.print(
                f"job {result.job}: [bold red]no restorable step[/] (world size {result.world_size})"
            )
        else:
            con.print(
                f"job {result.job}: a restore now picks [bold]step {result.step}[/] "
                f"(world size {result.world_size})"
            )
            output.table(
                None,
                ("rank", "served by", "location", "nearer tiers skipped"),
                [(r.rank, r.tier, r.location, "; ".join(r.skipped)) for r in result.ranks],
                con,
            )
        for line in result.newer_skipped:
            con.print(f"not restorable: {line}", markup=False)
        for line in result.notes:
            con.print(f"note: {line}", markup=False)
    return EXIT_OK if result.step is not None else EXIT_NOT_FOUND


def _verify(args: argparse.Namespace) -> int:
    from strata.cli import check

    with opened(args.locations) as locs:
        targets = check.targets(locs, jobs_in(locs, args.job), args.step)
        total = sum(t.nbytes or 0 for t in targets)
        with output.progress(total, "verifying", not args.no_progress) as advance:
            rows = check.verify_all(targets, advance)
        rows += check.commit_rows(locs, jobs_in(locs, args.job), args.step)
    summary = check.summary(rows)
    if args.output == "json":
        output.emit_json({"copies": rows, "summary": summary})
    else:
        con = output.stdout()
        output.table(
            None,
            ("tier", "location", "job", "step", "rank", "size", "status", "detail"),
            [
                (
                    r["tier"],
                    r["location"],
                    r["job"],
                    r["step"],
                    r["rank"] if r["rank"] is not None else r.get("object"),
                    output.human_bytes(r["bytes"]),
                    r["status"],
                    r["detail"],
                )
                for r in rows
            ],
            con,
        )
        by = ", ".join(f"{n} {s}" for s, n in sorted(summary["by_status"].items()))
        con.print(
            f"{summary['copies']} copies of {summary['steps']} step(s) checked "
            f"({output.human_bytes(summary['bytes_checked'])} read): {by}",
            markup=False,
        )
        if summary["bad"]:
            con.print(f"[bold red]{summary['bad']} bad copies[/]")
    return EXIT_BAD if summary["bad"] else EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from strata.cli.tree import leaves

    with opened(args.locations) as locs:
        tier = locs[0].tier
        listing = tier.list_steps(args.job).get(args.step)
        if listing is None or not listing.committed_ranks:
            raise NotFound(
                f"step {args.step} of job {args.job!r}: not committed in {args.locations[0]}; "
                "`strata list` shows the steps"
            )
        ranks = sorted(listing.committed_ranks)
        if args.rank is not None:
            if args.rank not in listing.committed_ranks:
                raise NotFound(f"rank {args.rank} of step {args.step} is not committed there")
            ranks = [args.rank]
        rows = [leaf for r in ranks for leaf in leaves(tier.get_manifest(args.job, args.step, r))]
    if args.output == "json":
        output.emit_json(rows)
        return EXIT_OK
    con = output.stdout()
    output.table(
        f"job {args.job} step {args.step}",
        ("rank", "key", "type", "dtype", "shape", "size / value"),
        [
            (
                r["rank"],
                r["key"],
                r["type"],
                r.get("dtype"),
                ("x".join(map(str, r["shape"])) or "()") if "shape" in r else None,
                output.human_bytes(r["bytes"])
                if r["type"] in ("tensor", "sharded")
                else r.get("value"),
            )
            for r in rows
        ],
        con,
    )
    tensors = [r for r in rows if r["type"] in ("tensor", "sharded")]
    con.print(
        f"{len(tensors)} tensors ({output.human_bytes(sum(r['bytes'] or 0 for r in tensors))}), "
        f"{len(rows) - len(tensors)} other values, ranks {ranks}",
        markup=False,
    )
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    try:
        from strata.cli.export import export
    except ImportError as exc:
        raise UsageError(
            f"export needs torch ({exc}); pip install 'strata-checkpoint[torch]'"
        ) from None
    fmt, dst = args.to[0], Path(args.to[1])
    if fmt not in ("safetensors", "dcp"):
        raise UsageError(f"--to {fmt}: choose safetensors or dcp")
    with opened(args.locations) as locs:
        total = 0
        for loc in locs[:1]:
            listing = loc.tier.list_steps(args.job).get(args.step)
            if listing is not None:
                for r in listing.committed_ranks:
                    with contextlib.suppress(TierError):
                        total += loc.tier.get_manifest(args.job, args.step, r).data_nbytes
        with output.progress(total, "reading", not args.no_progress) as advance:
            report = export(locs, args.job, args.step, fmt, dst, advance, args.max_shard_size)
    if args.output == "json":
        output.emit_json(report)
        return EXIT_OK
    con = output.stdout()
    con.print(
        f"exported step {report['step']} of {report['job']} ({report['world_size']} rank(s), "
        f"{report['tensors']} tensors, {output.human_bytes(report['tensor_bytes'])}, "
        f"{report['other_leaves']} other values) as {report['format']} to {report['dir']}",
        markup=False,
    )
    for r, src in sorted(report["sources"].items()):
        con.print(f"  rank {r} from {src}", markup=False)
    for line in report["skipped"] + report["notes"]:
        con.print(f"  note: {line}", markup=False)
    return EXIT_OK


_RUN = {"list": _list, "plan": _plan, "verify": _verify, "inspect": _inspect, "export": _export}
