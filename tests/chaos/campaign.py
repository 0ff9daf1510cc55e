"""Seeded fault-injection campaign against real processes, real tmpfs and fake-gcs-server.

Two parts, each bounded by its counts and reproducible from its seed:

- :func:`crash_campaign`: a real ``strata sidecar`` process and trainer processes
  (:mod:`tests.chaos.workload`). Each cycle a trainer restores (checked bit for bit), then
  saves; the cycle kills the trainer at a chosen fault point (``STRATA_FAULT``: after the copy,
  after the link, after the commit, before the checksum rewrite), the sidecar at one of its own
  (a promotion round, a PVC copy with its data written but no manifest, its checksum pass,
  staging) or by SIGKILL at a random moment, or both together. A killed sidecar is restarted,
  half the time at once while the trainer goes on saving (start-up pruning runs beside a live
  trainer), else after a back-off of 1-4 s as a kubelet would (the trainer saves without it
  and its restore waits for it), or after the cycle. The sidecar promotes to the PVC and, with
  ``gcs_endpoint``, to fake-gcs-server. Every restore must return exactly the state saved as
  that step, and never a step older than the newest one ``save()`` reported committed.
- :func:`corruption_campaign`: two steps committed in RAM, on the PVC and on GCS; one to three
  random bit flips, truncations or deletions of data objects or manifests of random tiers, or a
  wipe of the whole RAM tier (a node reboot); a restore must return exactly
  the newest step of which some copy is intact (an older one only when every copy of the newer
  one is damaged), or report that nothing is restorable when no copy is intact -- never other
  bytes, never an exception while a copy could serve.

``python -m tests.chaos.campaign --crash-points 2000 --corruptions 1000 --seed 1`` (``make
chaos``) prints the counts as JSON and exits 1 when any restore was wrong.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from strata.testing.ports import free_port as _free_port

TRAINER_POINTS = ("save.copied", "commit.linked", "commit.done", "seal.before")
SIDECAR_POINTS = ("promotion.round", "posix.data_written", "seal.before", "stage.copied")
JOB = "chaos.job"
STEPS_PER_CYCLE = 6
SIDECAR_BACKOFF_SECONDS = (1.0, 4.0)
"""How long a killed sidecar stays down when it is not restarted at once (a kubelet's first
restart back-off is 10 s; the trainer's restore waits up to 10 s for it, then reads the tiers)."""


READY_SECONDS = 120.0
"""How long a (re)started sidecar may take to become ready before the cycle counts a slow start
and starts it again (on a loaded machine an import can take a minute)."""
MAX_SLOW_STARTS_IN_A_ROW = 5


def crash_config(root: Path, gcs_endpoint: str | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "job_id": JOB,
        "ram": {"path": str(root / "ram"), "every": {"steps": 1}, "keep": 1},
        "pvc": {"path": str(root / "pvc"), "every": {"steps": 2}, "keep": 2},
        "restore": {"allow_fresh_start": True},
        "metrics_port": _free_port(),
        "metrics_host": "127.0.0.1",
        "writer_id": "chaos-pod",
        "termination_grace_seconds": 5,
    }
    if gcs_endpoint is not None:
        config["gcs"] = {
            "bucket": CRASH_BUCKET,
            "prefix": "crash",
            "endpoint": gcs_endpoint,
            "every": {"steps": 3},
            "keep": 2,
        }
    return config


CRASH_BUCKET = "chaos-crash"


def _gcs_client(endpoint: str) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": endpoint},
    )


class SlowStart(RuntimeError):
    """The sidecar did not become ready in :data:`READY_SECONDS` (counted, not fatal)."""


def write_counts(path: Path | None, counts: dict[str, Any]) -> None:
    """Replace ``path`` with ``counts`` as JSON atomically (a campaign killed mid-way leaves
    the counts of its last finished cycle)."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Sidecar:
    """A real sidecar process (restartable, optionally with a fault rule): forked from the
    campaign's forkserver (:func:`tests.chaos.workload.sidecar`), or with ``fresh=True`` a new
    ``python -m strata.cli sidecar`` interpreter per start (what a container does). Measured
    on a quiet 2-core machine, seed 3, 40 crash points with 20 sidecar restarts: 33 s forked,
    37 s fresh."""

    def __init__(
        self, config: dict[str, Any], log_dir: Path, ctx: Any = None, fresh: bool = False
    ) -> None:
        from strata.config import StrataConfig

        self.config = StrataConfig.parse(config)
        self.log_dir = log_dir
        self.ctx = ctx
        self.fresh = fresh or ctx is None
        self.proc: subprocess.Popen[bytes] | None = None
        self.forked: Any = None
        self.starts = 0

    def _exitcode(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        if self.forked is not None:
            code: int | None = self.forked.exitcode
            return code
        return None

    def _launch(self, env: dict[str, str]) -> None:
        log_path = self.log_dir / f"sidecar-{self.starts % 4}.log"
        self.proc, self.forked = None, None
        if not self.fresh:
            from tests.chaos import workload

            self.forked = self.ctx.Process(
                target=workload.sidecar, args=(env, str(log_path)), daemon=True
            )
            self.forked.start()
            return
        full = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")} | env
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "strata.cli", "sidecar"],
                env=full,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start(self, fault: str = "", ready_seconds: float = READY_SECONDS) -> None:
        """Start the process and wait until ``/healthz`` answers.

        Raises :class:`SlowStart` (the process killed) when it is not ready in
        ``ready_seconds``; returns early when it died at its fault point during start-up.
        """
        env = dict(self.config.to_env())
        if fault:
            env["STRATA_FAULT"] = fault
        self.starts += 1
        self._launch(env)
        url = f"http://127.0.0.1:{self.config.metrics_port}/healthz"
        deadline = time.monotonic() + ready_seconds
        while time.monotonic() < deadline:
            if self._exitcode() is not None:
                return  # died at its fault point during start-up: a crash point too
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise SlowStart(f"the sidecar did not become ready in {ready_seconds:.0f} s")

    def alive(self) -> bool:
        return (self.proc is not None or self.forked is not None) and self._exitcode() is None

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(60)
        elif self.forked is not None:
            if self.forked.exitcode is None:
                self.forked.kill()
            self.forked.join(60)

    def died_by_fault(self) -> bool:
        return self._exitcode() == -signal.SIGKILL


def _read_log(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def crash_campaign(
    root: Path,
    crash_points: int,
    seed: int,
    deadline: float | None = None,
    gcs_endpoint: str | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    ready_seconds: float = READY_SECONDS,
    fresh_sidecar: bool = False,
) -> dict[str, Any]:
    """Run cycles until ``crash_points`` processes were killed (see the module docstring), or
    until ``deadline`` (``time.monotonic()``) passes.

    ``gcs_endpoint``: a fake-gcs-server the sidecar also promotes to (every third step), so
    kills land inside GCS uploads too. ``progress`` receives the counts after every cycle. A
    sidecar that is not ready in ``ready_seconds`` is counted (``sidecar_slow_starts``) and
    started again; only :data:`MAX_SLOW_STARTS_IN_A_ROW` in a row end the campaign (its counts
    say so in ``aborted``). ``fresh_sidecar``: start each sidecar as a new interpreter instead
    of a fork of the preloaded forkserver (:class:`Sidecar`)."""
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "strata.client", "strata.sidecar.main", "google.cloud.storage"]
    ctx.set_forkserver_preload([*preload, "tests.chaos.workload"])
    from tests.chaos import workload

    rnd = random.Random(seed)
    config = crash_config(root, gcs_endpoint)
    if gcs_endpoint is not None:
        client = _gcs_client(gcs_endpoint)
        if client.lookup_bucket(CRASH_BUCKET) is None:
            client.create_bucket(CRASH_BUCKET)
        client.close()
    cfg_json = json.dumps(config)
    log = root / "trainer.log"
    sidecar = Sidecar(config, root, ctx, fresh=fresh_sidecar)
    counts: Counter[str] = Counter()
    last_saved: int | None = None
    cycles = 0
    aborted = ""

    def start(fault: str = "") -> None:
        nonlocal aborted
        for _ in range(MAX_SLOW_STARTS_IN_A_ROW):
            try:
                sidecar.start(fault, ready_seconds)
                return
            except SlowStart as exc:
                counts["sidecar_slow_starts"] += 1
                print(f"cycle {cycles}: {exc}; starting it again", flush=True)
        aborted = f"the sidecar was not ready {MAX_SLOW_STARTS_IN_A_ROW} times in a row"

    def snapshot() -> dict[str, Any]:
        out: dict[str, Any] = dict(counts)
        out["cycles"] = cycles
        out["last_saved_step"] = last_saved
        if aborted:
            out["aborted"] = aborted
        return out

    start()
    try:
        while counts["crash_points"] < crash_points and not aborted:
            if deadline is not None and time.monotonic() > deadline:
                counts["stopped_at_deadline"] = 1
                break
            cycles += 1
            victim = rnd.choice(["trainer", "sidecar", "both"])
            t_fault = ""
            if victim in ("trainer", "both"):
                point = rnd.choice(TRAINER_POINTS)
                t_fault = f"{point}#{rnd.randint(1, STEPS_PER_CYCLE)}"
            if victim in ("sidecar", "both") and rnd.random() < 0.5:
                # A fault point in the sidecar: it needs a restart to arm the rule.
                sidecar.kill()
                s_point = rnd.choice(SIDECAR_POINTS)
                start(f"{s_point}#{rnd.randint(1, 3)}")
                s_timed = None
            elif victim in ("sidecar", "both"):
                s_timed = rnd.random() * 0.3
            else:
                s_timed = None
            if not sidecar.alive() and not aborted:
                counts["crash_points"] += 1
                counts["sidecar_fault_kills"] += 1
                start()
            if aborted:
                break
            before = len(_read_log(log))
            p = ctx.Process(
                target=workload.trainer,
                args=(cfg_json, str(log), t_fault, STEPS_PER_CYCLE),
                daemon=True,
            )
            p.start()
            if s_timed is not None:
                time.sleep(s_timed)
                if sidecar.alive():
                    sidecar.kill()
                    counts["crash_points"] += 1
                    counts["sidecar_timed_kills"] += 1
                    if rnd.random() < 0.5:
                        # A sidecar-only restart: its start-up (pruning, incarnation records)
                        # runs while this trainer still saves.
                        start()
                        counts["sidecar_restarts_under_live_trainer"] += 1
                    else:
                        # As the kubelet does, after a back-off: meanwhile the trainer saves
                        # without it (and a restore waits for it); a trainer done sooner
                        # finishes its cycle without one.
                        p.join(rnd.uniform(*SIDECAR_BACKOFF_SECONDS))
                        if p.is_alive() and not aborted:
                            start()
                            counts["sidecar_restarts_after_backoff"] += 1
            p.join(300)
            if p.is_alive():
                p.kill()
                p.join()
                counts["trainer_hung"] += 1
            if p.exitcode == -signal.SIGKILL:
                counts["crash_points"] += 1
                counts["trainer_fault_kills"] += 1
            elif p.exitcode != 0:
                counts["trainer_errors"] += 1
            if sidecar.died_by_fault():
                counts["crash_points"] += 1
                counts["sidecar_fault_kills"] += 1
            if not sidecar.alive():
                start()
            for line in _read_log(log)[before:]:
                kind, _, rest = line.partition(" ")
                if kind == "restore":
                    step_s, verdict = rest.split()
                    counts["restores_checked"] += 1
                    step = None if step_s == "none" else int(step_s)
                    lost = last_saved is not None and (step is None or step < last_saved)
                    if verdict != "ok" or lost:
                        counts["wrong_restores"] += 1
                        print(f"WRONG restore in cycle {cycles}: {line} (last saved {last_saved})")
                    if step is not None:
                        counts["restored_steps"] = max(counts["restored_steps"], step)
                elif kind == "saved":
                    last_saved = int(rest)
            if progress is not None:
                progress(snapshot())
    finally:
        sidecar.kill()
    out = snapshot()
    if gcs_endpoint is not None:
        client = _gcs_client(gcs_endpoint)
        out["gcs_objects"] = sum(1 for _ in client.list_blobs(CRASH_BUCKET))
        client.close()
    return out


# -- corruptions ------------------------------------------------------------------------------------


def _flip(raw: bytes, rnd: random.Random, limit: int | None = None) -> bytes:
    n = len(raw) if limit is None else min(limit, len(raw))
    bit = rnd.randrange(n * 8)
    b = bytearray(raw)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def _damage(raw: bytes, how: str, rnd: random.Random, limit: int | None) -> bytes:
    """``raw`` with one bit flipped (within the first ``limit`` bytes) or cut short."""
    if how == "truncate":
        return raw[: rnd.randrange(len(raw))] if raw else raw
    return _flip(raw, rnd, limit)


def corruption_campaign(
    root: Path,
    corruptions: int,
    seed: int,
    gcs_endpoint: str | None,
    deadline: float | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Damage committed copies on every tier (bit flips, truncations, deletions, RAM wipes) and
    check every restore (module docstring). ``progress`` receives the counts after every
    round."""
    import torch  # noqa: F401  (the workload needs it)
    from google.cloud import storage

    from strata.client import Checkpointer
    from strata.config import StrataConfig
    from strata.errors import RestoreError
    from strata.format import layout
    from strata.tiers.gcs import GcsTier
    from strata.tiers.posix import PosixTier
    from strata.tiers.slots import SlotLease
    from tests.chaos import workload

    rnd = random.Random(seed)
    counts: Counter[str] = Counter()
    bucket = f"chaos-{seed}-{os.getpid()}"
    client: storage.Client | None = None
    if gcs_endpoint is not None:
        from google.auth.credentials import AnonymousCredentials

        client = storage.Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": gcs_endpoint},
        )
        client.create_bucket(bucket)
    i = 0
    while counts["corruptions"] < corruptions:
        if deadline is not None and time.monotonic() > deadline:
            counts["stopped_at_deadline"] = 1
            break
        i += 1
        job = f"chaos.corrupt-{i}"
        raw: dict[str, Any] = {
            "job_id": job,
            "ram": {"path": str(root / "ram"), "keep": 2},
            "pvc": {"path": str(root / "pvc")},
            "restore": {"allow_fresh_start": True},
        }
        if client is not None:
            raw["gcs"] = {"bucket": bucket, "prefix": "c", "endpoint": gcs_endpoint}
        config = StrataConfig.parse(raw)
        pvc = PosixTier(root / "pvc")
        gcs = GcsTier(config.gcs, client=client) if client is not None and config.gcs else None
        tiers: dict[str, Any] = {"pvc": pvc} | ({"gcs": gcs} if gcs is not None else {})
        with Checkpointer(config, rank=0, world_size=1) as c:
            for step in (1, 2):
                assert c.save(step, workload.state_for(step))
            c.wait()
            sizes: dict[int, int] = {}
            for step in (1, 2):
                with SlotLease(c.ram, job, step, 0) as lease:
                    assert lease.manifest is not None
                    sizes[step] = lease.manifest.data_nbytes
                    for t in tiers.values():
                        t.put_shard(job, step, 0, lease.path, lease.manifest)
            # Damage 1..3 copies: a bit flip, a truncation or a deletion of a data object or a
            # manifest, or a wipe of the node's whole RAM tier (a reboot).
            damaged: set[tuple[str, int]] = set()
            all_tiers = ["ram", *tiers]
            for _ in range(rnd.randint(1, 3)):
                tier = rnd.choice(all_tiers)
                if tier == "ram" and rnd.random() < 0.1:
                    shutil.rmtree(c.ram.root / job, ignore_errors=True)
                    damaged |= {("ram", 1), ("ram", 2)}
                    counts["corruptions"] += 1
                    counts["corrupt_ram_wipe"] += 1
                    continue
                step = rnd.choice((1, 2))
                kind = rnd.choice(("data", "manifest"))
                how = rnd.choices(("flip", "truncate", "delete"), weights=(2, 1, 1))[0]
                key = (layout.data_key if kind == "data" else layout.manifest_key)(job, step, 0)
                limit = sizes[step] if kind == "data" else None
                if tier in ("ram", "pvc"):
                    path = (c.ram.root if tier == "ram" else pvc.root) / key
                    if not path.exists():
                        continue
                    if how == "delete":
                        path.unlink()
                    else:
                        path.write_bytes(_damage(path.read_bytes(), how, rnd, limit))
                else:
                    assert client is not None and gcs is not None
                    blob = client.bucket(bucket).get_blob(gcs.object_name(key))
                    if blob is None:
                        continue
                    if how == "delete":
                        blob.delete()
                    else:
                        new = client.bucket(bucket).blob(blob.name)
                        new.metadata = dict(blob.metadata or {})
                        new.upload_from_string(_damage(blob.download_as_bytes(), how, rnd, limit))
                damaged.add((tier, step))
                counts["corruptions"] += 1
                counts[f"corrupt_{tier}_{kind}_{how}"] += 1
            intact = {s for s in (1, 2) if any((t, s) not in damaged for t in all_tiers)}
            expect = max(intact) if intact else None
            state = workload.empty_state()
            raised = False
            got: int | None = None
            try:
                got = c.restore(state).step
            except RestoreError:
                got = None
            except Exception as exc:  # restore must not raise while a copy can serve
                counts["wrong_restores"] += 1
                print(f"WRONG: restore raised in round {i} ({damaged}): {exc!r}")
                raised = True
            counts["restores_checked"] += 1
            if not raised:
                ok = got == expect and (got is None or workload.same_state(state, got))
                if not ok:
                    counts["wrong_restores"] += 1
                    print(
                        f"WRONG: round {i} damaged {sorted(damaged)}: restored {got}, expected {expect}"
                    )
                elif got is not None and got < 2:
                    counts["fell_back_to_older_step"] += 1
        shutil.rmtree(root / "ram" / job, ignore_errors=True)
        shutil.rmtree(root / "pvc" / job, ignore_errors=True)
        if gcs is not None:
            gcs.close()
        if progress is not None:
            progress(dict(counts) | {"rounds": i})
    if client is not None:
        client.close()
    out: dict[str, Any] = dict(counts)
    out["rounds"] = i
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crash-points", type=int, default=2000)
    ap.add_argument("--corruptions", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop each part after half of this and report the counts reached",
    )
    ap.add_argument(
        "--ready-seconds",
        type=float,
        default=READY_SECONDS,
        help="how long a restarted sidecar may take to be ready before a slow start is counted",
    )
    ap.add_argument(
        "--fresh-sidecar",
        action="store_true",
        help="start every sidecar as a new interpreter (as a container does), not as a fork "
        "of the preloaded forkserver",
    )
    args = ap.parse_args()
    from strata.testing.emulator import FakeGcsServer

    t0 = time.monotonic()
    partial: dict[str, Any] = {"seed": args.seed, "complete": False}

    def progress(part: str) -> Callable[[dict[str, Any]], None]:
        def write(counts: dict[str, Any]) -> None:
            partial[part] = counts
            partial["seconds"] = round(time.monotonic() - t0)
            write_counts(args.out, partial)

        return write

    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="strata-chaos-") as d:
        root = Path(d)
        (root / "crash").mkdir()
        (root / "corrupt").mkdir()
        half = None if args.max_seconds is None else args.max_seconds / 2
        with FakeGcsServer() as server:
            corrupt = corruption_campaign(
                root / "corrupt",
                args.corruptions,
                args.seed,
                server.endpoint,
                None if half is None else time.monotonic() + half,
                progress("corruption"),
            )
            print(json.dumps({"corruption": corrupt}), flush=True)
            # the crash part gets the rest of the budget (the corruptions often end early)
            crash = crash_campaign(
                root / "crash",
                args.crash_points,
                args.seed,
                None if args.max_seconds is None else t0 + args.max_seconds,
                gcs_endpoint=server.endpoint,
                progress=progress("crash"),
                ready_seconds=args.ready_seconds,
                fresh_sidecar=args.fresh_sidecar,
            )
    summary = {
        "seed": args.seed,
        "sidecar_start": "interpreter" if args.fresh_sidecar else "forkserver",
        "complete": not crash.get("aborted"),
        "seconds": round(time.monotonic() - t0),
        "crash": crash,
        "corruption": corrupt,
        "wrong_restores": crash.get("wrong_restores", 0) + corrupt.get("wrong_restores", 0),
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    raise SystemExit(1 if summary["wrong_restores"] else 0)


if __name__ == "__main__":
    main()
