"""The training client's unix-socket connect: EAGAIN (a full listen backlog) is retried with
backoff within the call's timeout (tenacity); any other error is raised at once."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest

from strata.client import sidecar_client
from strata.client.sidecar_client import UnixHTTPConnection

pytestmark = pytest.mark.unit


class FakeSocket:
    """A socket whose connect raises ``script``'s errors in turn, then connects."""

    script: list[OSError] = []
    made: list[FakeSocket] = []

    def __init__(self, family: int, kind: int) -> None:
        assert (family, kind) == (socket.AF_UNIX, socket.SOCK_STREAM)
        self.timeout: float | None = None
        self.closed = False
        self.connected_to: str | None = None
        FakeSocket.made.append(self)

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout

    def connect(self, path: str) -> None:
        if FakeSocket.script:
            raise FakeSocket.script.pop(0)
        self.connected_to = path

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_socket(monkeypatch: pytest.MonkeyPatch) -> type[FakeSocket]:
    FakeSocket.script, FakeSocket.made = [], []
    fake: Any = SimpleNamespace(
        socket=FakeSocket, AF_UNIX=socket.AF_UNIX, SOCK_STREAM=socket.SOCK_STREAM
    )
    monkeypatch.setattr(sidecar_client, "socket", fake)
    return FakeSocket


def test_a_full_backlog_is_retried_until_the_sidecar_accepts(
    fake_socket: type[FakeSocket],
) -> None:
    fake_socket.script = [BlockingIOError(11, "EAGAIN")] * 3
    conn = UnixHTTPConnection("/run/strata/api.sock", timeout=5.0)
    conn.connect()
    assert conn.sock is fake_socket.made[-1]
    assert fake_socket.made[-1].connected_to == "/run/strata/api.sock"
    assert fake_socket.made[-1].timeout == 5.0
    assert len(fake_socket.made) == 4 and all(s.closed for s in fake_socket.made[:3])


def test_a_backlog_that_stays_full_raises_within_the_timeout(
    fake_socket: type[FakeSocket],
) -> None:
    fake_socket.script = [BlockingIOError(11, "EAGAIN")] * 10_000
    conn = UnixHTTPConnection("/run/strata/api.sock", timeout=0.3)
    start = time.monotonic()
    with pytest.raises(BlockingIOError):
        conn.connect()
    assert time.monotonic() - start < 2.0
    assert 2 < len(fake_socket.made) < 100  # retried with backoff, not spun


def test_a_missing_socket_is_raised_at_once(fake_socket: type[FakeSocket]) -> None:
    fake_socket.script = [FileNotFoundError(2, "No such file")]
    with pytest.raises(FileNotFoundError):
        UnixHTTPConnection("/run/strata/api.sock", timeout=5.0).connect()
    assert len(fake_socket.made) == 1 and fake_socket.made[0].closed
