"""The sidecar's termination flush bookkeeping: one deadline per pod, passes until nothing is
pending, waits for a step, and the flush-fit estimate (pure logic; the real processes and
signals are in tests/integration/test_termination.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

from strata.reports import FlushEstimate, SidecarReport
from strata.sidecar.promotion import PromotionEvent
from strata.sidecar.promotion.flush import FlushResult
from strata.sidecar.termination import FlushMeter, TerminationFlush


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SteppingEngine:
    """Each flush pass makes the newest RAM step (``ram_step``, changed by the test) durable."""

    def __init__(self) -> None:
        self.ram_step = 10
        self.deadlines: list[float] = []
        self.gate = threading.Event()
        self.gate.set()

    def flush(self, deadline: float) -> FlushResult:
        self.gate.wait(30)
        self.deadlines.append(deadline)
        return FlushResult("pvc", self.ram_step, None, ok=True, message="promoted", nbytes=1)


def make(engine: Any, clock: Clock, grace: float = 30.0) -> TerminationFlush:
    return TerminationFlush(engine, grace, 5.0, clock=clock)


def test_the_deadline_runs_from_the_trainers_signal_and_is_only_brought_forward() -> None:
    clock, engine = Clock(), SteppingEngine()
    flush = make(engine, clock)
    assert flush.notice(since_signal_seconds=2.0) == 1000.0 - 2.0 + 30.0 - 5.0
    clock.now += 10
    # The sidecar's own SIGTERM later: the pod's SIGKILL comes no later for it.
    assert flush.notice(0.0, source="sidecar") == 1023.0
    assert flush.wait(None, timeout=30) is not None
    assert engine.deadlines and all(d == 1023.0 for d in engine.deadlines)


def test_a_wait_for_a_newer_step_gets_the_pass_that_made_it_durable() -> None:
    clock, engine = Clock(), SteppingEngine()
    flush = make(engine, clock)
    flush.notice()
    first = flush.wait(None, timeout=30)
    assert first is not None and first.durable_step == 10 and first.fit
    engine.ram_step = 13  # the trainer's final save after the notice
    flush.notice()
    last = flush.wait(13, timeout=30)
    assert last is not None and last.durable_step == 13
    assert flush.state() == (True, True)


def test_a_pass_past_the_deadline_does_not_fit() -> None:
    clock, engine = Clock(), SteppingEngine()
    flush = make(engine, clock, grace=6.0)  # deadline: 1 s after the notice
    engine.gate.clear()
    flush.notice()
    clock.now += 5
    engine.gate.set()
    out = flush.wait(None, timeout=30)
    assert out is not None and out.result.ok and not out.fit


def test_the_estimate_divides_the_newest_step_by_the_measured_throughput() -> None:
    meter = FlushMeter("pvc", grace_seconds=30.0, margin_seconds=5.0)
    assert meter.estimate().fits is None
    gib = 1 << 30
    meter.on_promotion_event(PromotionEvent("promoted", "gcs", 7, (0,), gib, 100.0))  # other tier
    meter.on_promotion_event(PromotionEvent("promoted", "pvc", 5, (0,), gib, 4.0))
    meter.on_promotion_event(PromotionEvent("promoted", "pvc", 10, (0,), 2 * gib, 8.0))
    est = meter.estimate()
    assert est.state_bytes == 2 * gib and est.bytes_per_second == gib / 4.0
    assert est.seconds_needed == 8.0 and est.budget_seconds == 25.0 and est.fits is True
    meter.on_promotion_event(PromotionEvent("promoted", "pvc", 20, (0,), 8 * gib, 32.0))
    assert meter.estimate().fits is False  # 8 GiB at 0.25 GiB/s: 32 s > 25 s
    # The report carries it; the operator validates reports with the same model.
    report = SidecarReport(policy="p", namespace="ns", pod_name="pod", job_id="ns.j", flush=est)
    again = SidecarReport.model_validate_json(report.model_dump_json())
    assert isinstance(again.flush, FlushEstimate) and again.flush.seconds_needed == 8.0


def test_a_trainer_announcing_its_final_save_gets_the_first_pass_held_for_it() -> None:
    clock, engine = Clock(), SteppingEngine()
    flush = make(engine, clock)
    flush.notice(hold=True)
    time.sleep(0.3)
    assert engine.deadlines == []  # held: the newest committed step is not copied first
    engine.ram_step = 11
    flush.notice()  # the trainer's request for its final step
    out = flush.wait(11, timeout=30)
    assert out is not None and out.durable_step == 11 and len(engine.deadlines) == 1


def test_the_hold_ends_by_itself_when_the_final_request_never_comes() -> None:
    clock, engine = Clock(), SteppingEngine()
    flush = make(engine, clock)
    flush.notice(hold=True)
    time.sleep(0.3)
    assert engine.deadlines == []
    clock.now += 10.5  # past min(10 s, 0.4 x 25 s)
    out = flush.wait(None, timeout=30)
    assert out is not None and out.durable_step == 10
