"""Time to ready: a real ``strata sidecar`` process from spawn to ``/healthz`` 200, while
CPU-saturating "trainer" processes run beside it, against an unloaded start and against the old
behaviour (the whole sidecar at nice 19 before it was ready).

``python -m bench.ready [--repeat 3] [--burners N] [--burn python|torch] [--timeout 300]``

Cases (each ``--repeat`` times, round-robin so slow drifts of a shared machine hit every case):

- ``idle``: no burners; the sidecar at the caller's nice value (what the pod gives it);
- ``loaded``: ``N`` burner processes (default ``os.cpu_count()``: a trainer saturating every
  core, one pure-Python loop or one single-threaded ``torch.mm`` loop each) started and spinning
  before the sidecar is spawned; the sidecar as it runs today (only steady-state promotion and
  peer threads lower themselves to nice 19, :mod:`strata.sidecar.priority`);
- ``loaded_nice19``: the same load, the sidecar started under ``nice -n 19`` (the old behaviour:
  ``lower_priority()`` as the process's first act, before its imports).

Per run: seconds from ``Popen`` to the first HTTP answer of the metrics port (imports done, 503
"starting"), to ``/healthz`` 200 (ready: what the injected startupProbe checks; the sidecar has
no separate ``/readyz``), and the sidecar's CPU seconds (user + system) by then. The startupProbe
budget the webhook gives an empty RAM tier is ``STARTUP_BASE_SECONDS`` (+ 2 s per GiB of RAM
tier), printed alongside. Medians go in the table with the ratios ``loaded / idle`` and
``loaded_nice19 / loaded``; every sample goes to ``bench/results/ready.json``.

The "idle" case is only as idle as the machine: the load average at each run's start is
recorded so a shared machine's background load is visible next to the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "ready.json"
REPO = Path(__file__).resolve().parents[1]
STARTUP_BASE_SECONDS = 30
"""The injected startupProbe's budget with no RAM tier to pre-fault
(``strata_operator.admission.mutation``: 30 s + ``startup_seconds_per_gib`` per GiB)."""
CASES = ("idle", "loaded", "loaded_nice19")

_BURN_PY = "while True:\n    pass\n"
_BURN_TORCH = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(256, 256)\n"
    "b = torch.randn(256, 256)\n"
    "while True:\n"
    "    a = torch.mm(a, b).clamp_(-1, 1)\n"
)


def _burners(n: int, kind: str) -> list[subprocess.Popen[bytes]]:
    """Start ``n`` single-core busy loops; return once each has burned some CPU."""
    code = _BURN_TORCH if kind == "torch" else _BURN_PY
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(_cpu_seconds(p.pid) > 0.2 for p in procs):
            break
        time.sleep(0.1)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(30)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    from strata.testing.ports import free_port

    return free_port()


def one_run(case: str, timeout: float) -> dict[str, Any]:
    """Spawn one sidecar in ``case``'s way; return its timings (seconds)."""
    ram = Path("/dev/shm") / f"strata-bench-ready-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="strata-bench-ready-"))
    try:
        ram.mkdir()
        return _time_one(case, timeout, ram, work)
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _time_one(case: str, timeout: float, ram: Path, work: Path) -> dict[str, Any]:
    from strata.config import StrataConfig

    config = StrataConfig.parse(
        {
            "job_id": "bench.ready",
            "ram": {"path": str(ram), "every": {"steps": 1}, "keep": 1},
            "pvc": {"path": str(work / "pvc"), "every": {"steps": 100}, "keep": 1},
            "metrics_port": _free_port(),
            "metrics_host": "127.0.0.1",
            "socket_path": str(work / "strata.sock"),
            "writer_id": "bench-pod",
        }
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(config.to_env())
    cmd = [sys.executable, "-m", "strata.cli", "sidecar"]
    if case == "loaded_nice19":
        cmd = ["nice", "-n", "19", *cmd]
    url = f"http://127.0.0.1:{config.metrics_port}/healthz"
    load1 = os.getloadavg()[0]
    first_answer = ready = None
    log_path = work / "sidecar.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"sidecar exited with {proc.returncode} before ready:\n{log_path.read_text()}"
                )
            status = 0
            with contextlib.suppress(OSError):
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        status = r.status
                except urllib.error.HTTPError as exc:
                    status = exc.code
            now = time.monotonic() - t0
            if status and first_answer is None:
                first_answer = now
            if status == 200:
                ready = now
                break
            time.sleep(0.02)
        cpu = _cpu_seconds(proc.pid)
    finally:
        proc.kill()
        proc.wait(30)
    return {
        "case": case,
        "first_answer_s": first_answer,
        "ready_s": ready,
        "timed_out": ready is None,
        "cpu_s_at_ready": cpu,
        "loadavg_1m_at_start": load1,
    }


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(summary: dict[str, Any], burners: int, burn: str) -> str:
    rows = [
        f"| case (medians of {summary['repeat']}) | first HTTP answer s | ready (/healthz 200) s "
        "| CPU s of the sidecar | load avg 1 min at start | timed out |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        s = summary["cases"][case]
        rows.append(
            f"| {case} | {_fmt(s['first_answer_s'])} | {_fmt(s['ready_s'])} "
            f"| {_fmt(s['cpu_s_at_ready'])} | {_fmt(s['loadavg_1m_at_start'])} "
            f"| {s['timed_out']}/{s['runs']} |"
        )
    r = summary["ratios"]
    rows.append("")
    rows.append(
        f"load: {burners} {burn} burner process(es) on {os.cpu_count()} CPUs; "
        f"startupProbe budget for an empty RAM tier: {STARTUP_BASE_SECONDS} s"
    )
    rows.append(
        f"ready loaded / idle: {_fmt(r['ready_loaded_over_idle'])}x; "
        f"ready loaded at nice 19 (old) / loaded (now): {_fmt(r['ready_nice19_over_loaded'])}x; "
        f"loaded (now) within the budget: {r['loaded_within_budget']}"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--burn", choices=("python", "torch"), default="python")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per start")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.burners < 1:
        parser.error("Strata: --repeat and --burners must be at least 1")
    samples: list[dict[str, Any]] = []
    for i in range(args.repeat):
        order = args.cases[i % len(args.cases) :] + args.cases[: i % len(args.cases)]
        for case in order:
            burners = _burners(args.burners, args.burn) if case != "idle" else []
            try:
                sample = one_run(case, args.timeout)
            finally:
                _stop(burners)
            sample["round"] = i
            samples.append(sample)
            print(
                f"round {i} {case}: ready {_fmt(sample['ready_s'])} s "
                f"(first answer {_fmt(sample['first_answer_s'])} s, "
                f"CPU {_fmt(sample['cpu_s_at_ready'])} s, "
                f"load {sample['loadavg_1m_at_start']:.2f})",
                flush=True,
            )
    cases: dict[str, Any] = {}
    for case in CASES:
        mine = [s for s in samples if s["case"] == case]
        cases[case] = {
            key: _median([s[key] for s in mine])
            for key in ("first_answer_s", "ready_s", "cpu_s_at_ready", "loadavg_1m_at_start")
        }
        cases[case]["timed_out"] = sum(1 for s in mine if s["timed_out"])
        cases[case]["runs"] = len(mine)

    def ratio(a: str, b: str) -> float | None:
        x, y = cases[a]["ready_s"], cases[b]["ready_s"]
        return None if x is None or not y else x / y

    loaded = [s["ready_s"] for s in samples if s["case"] == "loaded"]
    summary: dict[str, Any] = {
        "repeat": args.repeat,
        "burners": args.burners,
        "burn": args.burn,
        "cpus": os.cpu_count(),
        "timeout_s": args.timeout,
        "startup_budget_s": STARTUP_BASE_SECONDS,
        "cases": cases,
        "ratios": {
            "ready_loaded_over_idle": ratio("loaded", "idle"),
            "ready_nice19_over_loaded": ratio("loaded_nice19", "loaded"),
            "loaded_within_budget": bool(loaded)
            and all(x is not None and x <= STARTUP_BASE_SECONDS for x in loaded),
        },
        "note": "'idle' has no burners of its own but shares the machine with whatever else runs "
        "(see loadavg_1m_at_start)",
        "samples": samples,
    }
    print()
    print(table(summary, args.burners, args.burn))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
