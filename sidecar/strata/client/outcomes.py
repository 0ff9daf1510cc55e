"""What one rank's saves did: :class:`SaveOutcomes` (counts, stalls, the newest error, events).

The failure policy is :class:`strata.client.checkpointer.Checkpointer`'s (its module docstring):
a failed save is logged at ERROR, counted and reported, and training continues. The interval
rule of the RAM tier (:meth:`SaveOutcomes.should_save`) is :mod:`strata.intervals`' (shared
with the sidecar's promotion), measured from the last successful save. Thread-safe enough for
its writers: the training thread and the single background thread of the save path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from strata.config import Interval
from strata.intervals import due_now, interval_policy
from strata.protocol import ClientEvent, SaveEvent

log = logging.getLogger("strata.client")


class SaveOutcomes:
    """Outcomes of the saves of ``rank`` of ``job_id``; each is reported to ``report`` as one
    :class:`strata.protocol.SaveEvent`. ``every``: the RAM tier's interval."""

    def __init__(
        self, job_id: str, rank: int, every: Interval, report: Callable[[ClientEvent], None]
    ) -> None:
        self.job_id = job_id
        self.rank = rank
        self.every = every
        self.report = report
        self.last_error: str | None = None
        """The newest failure of a save or of a background checksum pass (None: none yet)."""
        self.failed_saves = 0
        self.saves = 0
        self.last_stall_seconds: float | None = None
        self.stall_seconds: list[float] = []
        """The stall of every successful save, seconds, in order."""
        self.last_saved_step: int | None = None
        self._last_save_time: float | None = None

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a RAM checkpoint (``every``: steps and/or seconds)."""
        return due_now(interval_policy(self.every), step, time.monotonic(), self._last_save_time)

    def failed(self, step: int, exc: BaseException) -> None:
        """The save of ``step`` failed with ``exc`` (the previous committed step is intact)."""
        self.failed_saves += 1
        self.last_error = f"save of step {step} failed: {exc}"
        log.error(
            "strata: save of step %d failed (training continues; the previous committed "
            "step is intact): %s",
            step,
            exc,
        )
        self.report(
            SaveEvent(job_id=self.job_id, rank=self.rank, step=step, ok=False, error=str(exc))
        )

    def succeeded(self, step: int, stall: float) -> None:
        """``step`` is committed in RAM; the save blocked training for ``stall`` seconds."""
        self.report(
            SaveEvent(job_id=self.job_id, rank=self.rank, step=step, ok=True, stall_seconds=stall)
        )
        self.last_stall_seconds = stall
        self.stall_seconds.append(stall)
        self.saves += 1
        self.last_saved_step = step
        self._last_save_time = time.monotonic()

    def error(self, message: str) -> None:
        """A failure after the save (a checksum pass): recorded as ``last_error``, logged."""
        self.last_error = message
        log.error("strata: %s", message)
