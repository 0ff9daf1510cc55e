"""Keep looking for a sidecar that did not answer when the Checkpointer started.

Outside Kubernetes the trainer and ``strata sidecar`` are started side by side, and the sidecar
is often ready a moment after the trainer built its Checkpointer. The sidecar promotes the steps
committed in the RAM tier after it started, whoever wrote them, so such a job is protected once
it answers; only the slots stay the trainer's own until it restarts (the sidecar's pre-faulted slots are taken at
start-up only). So instead of declaring at once that nothing is promoted, :class:`SidecarWatch`
polls the socket in a daemon thread (every ``poll_seconds``, doubling up to
``max_poll_seconds``), warns once when none answered within ``grace_seconds``, and logs when one
answers (then stops). In a pod the webhook's native sidecar is ready before the trainer starts,
so the watch is not even started there.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from strata.client.sidecar_client import SidecarClient
from strata.errors import StrataError

log = logging.getLogger("strata.client")


class SidecarWatch:
    """Polls ``socket`` for a ready sidecar in a daemon thread until one answers or :meth:`stop`.

    ``promoted_to``: the tiers it would promote to, for the messages ("pvc and gcs").
    ``grace_seconds``: how long a late sidecar is waited for before the warning that saves stay
    in RAM (the watch goes on after it). ``found`` is set once a sidecar answered.
    """

    def __init__(
        self,
        socket: str | Path,
        promoted_to: str,
        grace_seconds: float = 10.0,
        poll_seconds: float = 0.5,
        max_poll_seconds: float = 30.0,
    ) -> None:
        if grace_seconds < 0 or poll_seconds <= 0 or max_poll_seconds < poll_seconds:
            raise ValueError(
                "SidecarWatch needs grace_seconds >= 0 and 0 < poll_seconds <= max_poll_seconds, "
                f"got {grace_seconds}, {poll_seconds}, {max_poll_seconds}"
            )
        self.socket = Path(socket)
        self.promoted_to = promoted_to
        self.grace_seconds = grace_seconds
        self.poll_seconds = poll_seconds
        self.max_poll_seconds = max_poll_seconds
        self.found = threading.Event()
        self.warned = False
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="strata-sidecar-watch", daemon=True)
        self._thread.start()

    def _answers(self) -> bool:
        if not self.socket.is_socket():
            return False
        try:
            return SidecarClient(self.socket, timeout=2.0).ready()
        except (StrataError, OSError):  # starting up, or a stale socket file
            return False

    def _run(self) -> None:
        delay = self.poll_seconds
        while True:
            if self._answers():
                self.found.set()
                log.warning(
                    "strata: a sidecar answers on %s now (%.1f s after the trainer started): it "
                    "promotes the steps committed from now on to %s; this process keeps its own "
                    "RAM slots until it restarts",
                    self.socket,
                    time.monotonic() - self._started,
                    self.promoted_to,
                )
                return
            if not self.warned and time.monotonic() - self._started >= self.grace_seconds:
                self.warned = True
                log.warning(
                    "strata: no sidecar answers on %s after %.0f s: saves stay in the RAM tier "
                    "and are NOT promoted to %s until one does (still looking); run `strata "
                    "sidecar` with the same configuration (in Kubernetes the webhook injects it). "
                    "Restores still search every tier.",
                    self.socket,
                    self.grace_seconds,
                    self.promoted_to,
                )
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, self.max_poll_seconds)

    def stop(self) -> None:
        """Stop looking (the Checkpointer's ``close``); returns once the thread ended."""
        self._stop.set()
        self._thread.join(timeout=10)
