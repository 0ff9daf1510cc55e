"""The trainer's SIGTERM handler in this process, with real signals: it chains to the user's
handler, installs only from the main thread, and ends a process whose loop never polls."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from strata.client.termination import Termination
from strata.config import StrataConfig


class Owner:
    """What Termination uses of a Checkpointer (no sidecar socket: the notice is only logged)."""

    def __init__(self, ram: Path) -> None:
        self.config = StrataConfig.parse({"job_id": "ns.t", "ram": {"path": str(ram)}})
        self.job_id, self.rank, self.process_group = "ns.t", 0, None
        self.last_saved_step: int | None = None
        self.saved: list[int] = []

    def save(self, step: int, state: Any) -> bool:
        self.saved.append(step)
        self.last_saved_step = step
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def deliver() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs at the main thread's next bytecode


def test_a_users_handler_is_chained_and_then_the_loop_decides(
    tmp_path: Path, restore_sigterm: None
) -> None:
    calls: list[int] = []

    def users(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    signal.signal(signal.SIGTERM, users)
    owner = Owner(tmp_path)
    term = Termination(owner, install=True)
    assert not term.should_stop(1, {"x": 1})
    deliver()  # no SystemExit: the user's handler and the loop stop the program
    assert calls == [signal.SIGTERM] and term.requested
    assert term.should_stop(7, {"x": 1})
    assert owner.saved == [7] and term.exit_code == 143
    term.close()
    assert signal.getsignal(signal.SIGTERM) is users


def test_without_a_poller_or_a_users_handler_sigterm_ends_the_process(
    tmp_path: Path, restore_sigterm: None
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    term = Termination(Owner(tmp_path), install=True)
    try:
        with pytest.raises(SystemExit) as exc:
            deliver()
        assert exc.value.code == 143
    finally:
        term.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_the_handler_is_installed_only_from_the_main_thread(
    tmp_path: Path, restore_sigterm: None
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(Termination(Owner(tmp_path)).install()))
    t.start()
    t.join()
    assert out == [False]
    assert signal.getsignal(signal.SIGTERM) is before
