"""The sidecar process (``strata sidecar``): start-up, serving, promotion loop, SIGTERM flush.

Life cycle (docs/architecture.md "Parts and data flow"):

1. Configuration: :meth:`StrataConfig.from_env` and the tier policies; invalid -> exit 2 with a
   message naming the setting (:func:`main`).
2. ``/metrics`` and ``/healthz`` on ``metrics_host:metrics_port`` start first; ``/healthz`` is
   503 until start-up is done (the pod's startupProbe; Kubernetes starts the trainer only after a
   native sidecar's startupProbe passed, so the trainer never races the pruning below).
3. Start-up: prune this job's RAM directory to the newest committed step per rank (C-12),
   re-open the slot rings a previous incarnation left (surplus free slots are released), take
   the heartbeat, then open the local API socket and become ready. In the background, prefetch
   the newest complete durable step into RAM for ranks the RAM directory knows
   (:meth:`Sidecar.prefetch`).
4. Running: the promotion loop (:class:`strata.sidecar.promotion.PromotionEngine`), the heartbeat
   (``<ram>/<job>/.strata-heartbeat`` for the hostPath janitor), periodic reports.
5. Termination: the trainer's notice (``POST /v1/terminate`` from its SIGTERM handler; a native
   sidecar's own SIGTERM comes only after the trainer exited) or the sidecar's SIGTERM/SIGINT
   stops promoting by interval and starts the flush at once
   (:class:`strata.sidecar.termination.TerminationFlush`): if the newest committed RAM step is
   newer than every durable step, promote it to the fastest durable tier before the first
   notice's signal time + ``termination_grace_seconds - TERM_MARGIN_SECONDS`` (C-14). On its own
   SIGTERM the sidecar joins that flush, sends a last report and exits 0 after a clean flush, 1
   when the flush failed (logged as an error). SIGKILL loses at most the RAM
   tier: durable commits are atomic (manifest last), so a killed promotion leaves only
   uncommitted data that the next sidecar overwrites or garbage-collects.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping
from types import FrameType
from typing import Any

from strata.config import StrataConfig
from strata.errors import TierError
from strata.peers.service import PeerService
from strata.sidecar.activity import Activity
from strata.sidecar.http import Routes, serve_tcp, serve_unix
from strata.sidecar.janitor import touch_heartbeat
from strata.sidecar.local_api import LocalApi
from strata.sidecar.metrics import Metrics
from strata.sidecar.priority import lower_thread_priority
from strata.sidecar.promotion import PromotionEngine, PromotionEvent
from strata.sidecar.promotion.flush import FlushResult
from strata.sidecar.promotion.policies import tier_policies
from strata.sidecar.reporter import Reporter
from strata.sidecar.termination import (
    MIN_FLUSH_SECONDS,
    FlushMeter,
    FlushOutcome,
    TerminationFlush,
)
from strata.tiers.base import Tier
from strata.tiers.configured import durable_tiers, in_restore_order
from strata.tiers.eligible import job_lineage, tier_steps
from strata.tiers.medium import check_ram_medium
from strata.tiers.ram import RamTier

log = logging.getLogger("strata.sidecar")

TERM_MARGIN_SECONDS = 5.0
"""Seconds kept between the flush deadline and the pod's SIGKILL (last report, exit)."""
TERM_POLL_SECONDS = 0.5
"""The main thread wakes this often to run a pending SIGTERM handler (see :meth:`Sidecar.serve`)."""
HEARTBEAT_SECONDS = 10.0
REPORT_SECONDS = 15.0


class Sidecar:
    """One sidecar: owns the tiers, the engine, the servers and the background threads."""

    def __init__(
        self,
        config: StrataConfig,
        *,
        poll_seconds: float = 0.5,
        report_seconds: float = REPORT_SECONDS,
        prefetch: bool = True,
    ) -> None:
        self.config = config
        self.policies = tier_policies(config)  # PolicyError names a conflicting setting
        self.writer_id = config.pod_writer_id
        check_ram_medium(config.ram.path, who="strata sidecar")
        self.ram = RamTier(config.ram.path, keep=config.ram.keep)
        # Retried GCS calls give up after a minute: the next round retries anyway, and a tier
        # lock held for GCS's default two minutes would delay retention and reports.
        durable = durable_tiers(config, writer_id=self.writer_id, gcs_retry_timeout=60.0)
        self.durable = durable
        self.metrics = Metrics()
        self.engine = PromotionEngine(
            config, self.ram, durable, policies=self.policies, on_event=self._on_promotion_event
        )
        grace = config.termination_grace_seconds
        self.flush_meter = FlushMeter(self.engine.fastest_durable(), grace, TERM_MARGIN_SECONDS)
        self.metrics.flush_seconds_needed.set_function(
            lambda: _nan_if_none(self.flush_meter.estimate().seconds_needed)
        )
        self.metrics.flush_budget_seconds.set(self.flush_meter.budget_seconds)
        self.termination = TerminationFlush(
            self.engine, grace, TERM_MARGIN_SECONDS, on_outcome=self._on_flush
        )
        self.poll_seconds = poll_seconds
        self.prefetch_enabled = prefetch
        self.report_seconds = report_seconds
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.terminate = threading.Event()
        self.activity = Activity(
            config, self.metrics, [self.ram, *durable.values()], self.engine.local_ranks
        )
        self.reporter = self._make_reporter()
        # Peer tier (docs/peers.md): serves this node's copies, keeps the peers', restores from
        # them. Binds its port now: a taken port or missing TLS material fails start-up.
        self.peers = PeerService.for_sidecar(config, self.ram, self._on_peer_event)
        self.api = LocalApi(
            config,
            self.ram,
            self.restore_tiers,
            self.engine,
            self.metrics,
            self.activity.on_client_event,
            self.ready.is_set,
            termination=self.termination,
            flush_estimate=self.flush_meter.estimate,
        )
        self._unix: Any = None
        self._tcp: Any = None
        self._threads: list[threading.Thread] = []

    # -- tiers ------------------------------------------------------------------------------------

    def restore_tiers(self) -> list[Tier]:
        peer = self.peers.tier if self.peers is not None else None
        return in_restore_order(self.config, self.ram, self.durable, peer)

    def _on_peer_event(self, kind: str, detail: Mapping[str, object]) -> None:
        """Peer copies count as promotions to the ``peer`` tier in the metrics; a corrupt copy
        served by a peer is a checksum mismatch and a reported error."""
        log.info("peer %s: %s", kind, dict(detail), extra={"event": f"peer_{kind}", **detail})
        nbytes = detail.get("nbytes")
        if kind in ("replicated", "encoded") and isinstance(nbytes, int):
            self.metrics.promotion_bytes.labels(tier="peer").inc(nbytes)
        elif kind == "corrupt_peer":
            self.metrics.checksum_mismatches.labels(tier="peer").inc()
            self.activity.error("peer", f"a peer served a corrupt copy, skipped: {dict(detail)}")

    # -- events -> metrics and reports ------------------------------------------------------------

    def _make_reporter(self) -> Reporter | None:
        c = self.config
        if not c.report.endpoint:
            return None
        missing = [k for k in ("policy", "namespace", "pod_name") if not getattr(c, k)]
        if missing:
            log.warning(
                "reports disabled: report.endpoint is set but %s missing (the webhook sets them)",
                ", ".join(missing),
            )
            return None
        return Reporter(c.report, on_drop=lambda _why: self.metrics.reports_dropped.inc())

    def _on_promotion_event(self, event: PromotionEvent) -> None:
        self.flush_meter.on_promotion_event(event)
        self.activity.on_promotion_event(event)

    def _on_flush(self, outcome: FlushOutcome) -> None:
        """Log every pass of the termination flush; a failed one is a reported error."""
        self.flush_meter.on_flush(outcome)
        result = outcome.result
        extra = {
            "event": "flush",
            "ok": result.ok,
            "fit": outcome.fit,
            "tier": result.tier,
            "step": result.ram_step,
            "bytes": result.nbytes,
            "seconds": round(outcome.seconds, 3),
        }
        if result.ok:
            log.info(
                "termination flush: %s (RAM step %s, durable step before %s, tier %s, %d bytes, "
                "%.3fs)",
                result.message,
                result.ram_step,
                result.durable_step,
                result.tier,
                result.nbytes,
                outcome.seconds,
                extra=extra,
            )
        else:
            log.error(
                "termination flush FAILED: RAM step %s did not reach the %s tier before the "
                "deadline: %s",
                result.ram_step,
                result.tier,
                result.message,
                extra=extra,
            )
            self.activity.error(
                result.tier, f"termination flush of step {result.ram_step} failed: {result.message}"
            )
        self.activity.report_due.set()

    def send_report(self, only: Collection[str] | None = None) -> None:
        if self.reporter is None:
            self.activity.tier_states(only)  # keeps strata_last_committed_step current
            return
        report = self.activity.build_report(only)
        if report is not None:
            self.reporter.submit(report.model_copy(update={"flush": self.flush_meter.estimate()}))

    # -- life cycle -------------------------------------------------------------------------------

    def start_metrics(self) -> None:
        if self.config.metrics_port == 0:
            return
        routes = Routes()
        routes.add_raw(
            "GET",
            "/metrics",
            lambda: (200, "text/plain; version=0.0.4; charset=utf-8", self.metrics.render()),
        )
        routes.add_raw(
            "GET",
            "/healthz",
            lambda: (
                (200, "text/plain", b"ok\n")
                if self.ready.is_set()
                else (503, "text/plain", b"starting\n")
            ),
        )
        self._tcp = serve_tcp(self.config.metrics_host, self.config.metrics_port, routes)
        log.info(
            "metrics on http://%s:%d/metrics",
            self.config.metrics_host,
            self._tcp.server_address[1],
            extra={"event": "metrics_listening"},
        )

    def start_up(self) -> None:
        """C-12 pruning, slot rings, heartbeat; then the local API and readiness."""
        job_dir = self.ram.root / self.config.job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        removed = self.engine.prune_ram()
        ranks = self.engine.local_ranks()
        for rank in sorted(ranks):
            slots = self.ram.slot_states(self.config.job_id, rank)
            log.info(
                "re-opened %d RAM slots of rank %d",
                len(slots),
                rank,
                extra={
                    "event": "slots_reopened",
                    "rank": rank,
                    "slots": [s.path.name for s in slots],
                },
            )
        touch_heartbeat(self.ram.root, self.config.job_id)
        newest = self.engine.newest_ram_step(ranks) if ranks else None
        if newest is not None:
            self.metrics.last_committed_step.labels(tier="ram").set(newest)
        if self.peers is not None:
            self.peers.start()
        self._unix = serve_unix(self.config.socket, self.api.routes())
        self.ready.set()
        log.info(
            "sidecar ready: job %s, RAM %s (newest step %s, %d stale shards pruned), durable tiers %s, socket %s",
            self.config.job_id,
            self.ram.root,
            newest,
            len(removed),
            list(self.durable),
            self.config.socket,
            extra={"event": "ready"},
        )

    def prefetch(self) -> list[tuple[int, int, str]]:
        """Bring the newest eligible durable step (committed and live in the lineage of every
        incarnation record found: :mod:`strata.tiers.eligible`, the rule the restore applies)
        into RAM for the ranks this RAM tier already knows (slot rings left by a previous
        incarnation), when RAM holds nothing as new.

        Runs in the background after readiness, so the trainer's restore is a RAM hit. Ranks are
        only known from the RAM directory (a recreated pod with an empty emptyDir has none; the
        trainer's restore then stages on demand). Returns ``(rank, step, tier)`` staged.
        """
        job = self.config.job_id
        ranks = self.engine.local_ranks()
        if not ranks:
            return []
        newest: tuple[int, int] | None = None  # (step, world size)
        lin = job_lineage(self.durable.values(), job, extra=self.engine.world.records)
        for tier in self.durable.values():
            try:
                eligible = tier_steps(tier, job, lin, resumable=True).eligible
            except TierError as exc:
                log.info("prefetch: cannot list %s: %s", tier.name, exc)
                continue
            for step, commit in eligible.items():
                if newest is None or step > newest[0]:
                    newest = (step, commit.world_size)
        if newest is None:
            return []
        step, world = newest
        ram_steps = self.ram.list_steps(job)
        staged: list[tuple[int, int, str]] = []
        for rank in sorted(r for r in ranks if r < world):
            mine = [s for s, li in ram_steps.items() if rank in li.committed_ranks]
            if mine and max(mine) >= step:
                continue
            request = {"job_id": job, "rank": rank, "step": step, "world_size": world}
            try:
                status, body = self.api.stage(request)
            except Exception as exc:
                log.warning("prefetch of rank %d step %d failed: %s", rank, step, exc)
                continue
            if status == 200:
                staged.append((rank, step, str(body["tier"])))
                log.info(
                    "prefetched rank %d of step %d from %s into RAM",
                    rank,
                    step,
                    body["tier"],
                    extra={"event": "prefetched", "rank": rank, "step": step, "tier": body["tier"]},
                )
        return staged

    def _loop(self, name: str, every: float, body: Any) -> None:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    body()
                except Exception:
                    log.exception("%s failed; continuing", name)
                self.stop.wait(every)

        t = threading.Thread(target=run, name=f"strata-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _report_loop(self) -> None:
        last = 0.0
        while not self.stop.is_set():
            self.activity.report_due.wait(timeout=self.report_seconds)
            if self.stop.is_set():
                return
            # Coalesce bursts (a promotion to PVC and GCS in one round) into one report.
            wait = 1.0 - (time.monotonic() - last)
            if wait > 0 and self.stop.wait(wait):
                return
            self.activity.report_due.clear()
            last = time.monotonic()
            try:
                self.send_report()
            except Exception:
                log.exception("building a report failed")

    def _prefetch_quietly(self) -> None:
        staged: list[tuple[int, int, str]] = []
        try:
            staged = self.prefetch()
        except Exception:
            log.exception("prefetch failed; the trainer's restore stages on demand")
        log.info(
            "start-up prefetch done (%d shard(s) staged into RAM)",
            len(staged),
            extra={"event": "prefetch-done", "staged": len(staged)},
        )

    def start_background(self) -> None:
        t = threading.Thread(
            target=_politely(self.engine.run),
            args=(self.stop, self.poll_seconds),
            name="strata-promotion",
            daemon=True,
        )
        t.start()
        self._threads.append(t)
        self._loop(
            "heartbeat",
            HEARTBEAT_SECONDS,
            lambda: touch_heartbeat(self.ram.root, self.config.job_id),
        )
        if self.prefetch_enabled:
            p = threading.Thread(target=self._prefetch_quietly, name="strata-prefetch", daemon=True)
            p.start()
            self._threads.append(p)
        r = threading.Thread(target=self._report_loop, name="strata-report-loop", daemon=True)
        r.start()
        self._threads.append(r)
        if self.peers is not None:
            p = threading.Thread(
                target=_politely(self.peers.run), args=(self.stop,), name="strata-peers"
            )
            p.daemon = True
            p.start()
            self._threads.append(p)
        self.activity.report_due.set()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("received %s", signal.Signals(signum).name, extra={"event": "signal"})
            self.terminate.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def shutdown(self) -> int:
        """SIGTERM path: join (or start) the termination flush of the newest RAM step to the
        fastest durable tier (C-14), send a last report, close. 0 after a clean flush, else 1."""
        self.stop.set()
        deadline = self.termination.notice(0.0, source="sidecar")
        wait = max(deadline - time.monotonic(), 0.0) + MIN_FLUSH_SECONDS + 1.0
        outcome = self.termination.wait(None, timeout=wait)
        result = (
            outcome.result
            if outcome is not None
            else FlushResult(
                None, None, None, ok=False, message="no flush pass finished before the deadline"
            )
        )
        remaining = deadline + TERM_MARGIN_SECONDS - time.monotonic()
        try:
            self.send_report(only=("ram", result.tier) if result.tier else ("ram",))
        except Exception:
            log.exception("last report failed")
        if self.reporter is not None:
            self.reporter.close(timeout=max(0.5, min(3.0, remaining - 1.0)))
        self.close_servers()
        return 0 if result.ok else 1

    def close_servers(self) -> None:
        for server in (self._unix, self._tcp):
            if server is not None:
                server.shutdown()
                server.server_close()
        self._unix = self._tcp = None
        with contextlib.suppress(FileNotFoundError):
            self.config.socket.unlink()
        for tier in self.durable.values():
            tier.close()
        if self.peers is not None:
            self.peers.close()

    def serve(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit status."""
        self.install_signal_handlers()
        self.start_metrics()
        self.start_up()
        self.start_background()
        # A timed wait: a process-directed SIGTERM may be delivered to any thread; CPython runs
        # the handler only when the main thread next executes bytecode, which an untimed
        # Event.wait() never does.
        while not self.terminate.wait(TERM_POLL_SECONDS):
            pass
        return self.shutdown()


def _politely(body: Callable[..., None]) -> Callable[..., None]:
    """``body`` run in a thread lowered to steady-state priority (:mod:`strata.sidecar.priority`)."""

    def run(*args: Any) -> None:
        lower_thread_priority()
        body(*args)

    return run


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value
