"""Restore that survives the sidecar disappearing.

:class:`SidecarFallbackStager` is the :class:`strata.client.stager.Stager` a trainer uses
when a sidecar answered at start-up. Each inventory or staging call goes to the sidecar; when
the sidecar stops answering (its container crashed, was OOM-killed or is restarting:
:class:`strata.errors.ProtocolError`), it waits up to ``wait_seconds`` for a sidecar to answer
again and retries there once, else it does that call itself with direct tier access
(``local``); once a wait ran out, later calls do not wait again while the sidecar still does
not answer (a restore's inventory and staging wait once in all, not once each). Either way it
says what happened in the inventory's notes or the staging result's ``skipped``, which
:meth:`Checkpointer.restore` returns in ``RestoreResult.skipped``. A restore therefore never
raises because the sidecar went away while every tier is intact.

torch-free (imported with :mod:`strata.client.sidecar_client`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from strata.client.stager import SidecarStager, Stager
from strata.errors import ProtocolError
from strata.protocol import ClientEvent, StageRequest
from strata.restore import RankInventory, StageResult

log = logging.getLogger("strata.client")

T = TypeVar("T")


class SidecarFallbackStager:
    """Sidecar first; on a :class:`ProtocolError`, wait up to ``wait_seconds`` (polling every
    ``poll_seconds``) for it, retry once, else use ``local`` (see the module docstring)."""

    def __init__(
        self,
        sidecar: SidecarStager,
        local: Stager,
        wait_seconds: float = 10.0,
        poll_seconds: float = 0.2,
    ) -> None:
        self.sidecar = sidecar
        self.local = local
        self.wait_seconds = wait_seconds
        self.poll_seconds = poll_seconds
        self.defers_in_place_verify = False
        """Whether the last staging left a RAM hit unverified: the sidecar is asked to leave
        it to the client, which verifies it while loading it (one pass over the shard, not the
        sidecar's checksum pass then the client's copy); a sidecar that does not know the
        request verifies it itself, and the local stager never verifies it."""
        self.gone: ProtocolError | None = None
        """Set when the sidecar did not answer again within ``wait_seconds``: later calls go
        to ``local`` at once (noted) until it answers again (``ready()``)."""

    def _call(
        self, what: str, on_sidecar: Callable[[], T], locally: Callable[[], T]
    ) -> tuple[T, str | None]:
        if self.gone is not None and not self.sidecar.ready():
            # It did not come back within the wait of an earlier call: waiting again for each
            # call of this restore (inventory, then staging, per round) only delays it.
            note = (
                f"sidecar: still not answering for the restore's {what} ({self.gone}); read "
                "the tiers directly"
            )
            log.warning("strata restore: %s", note)
            return locally(), note
        try:
            res = on_sidecar()
            self.gone = None
            return res, None
        except ProtocolError as exc:
            first = exc
        deadline = time.monotonic() + self.wait_seconds
        while time.monotonic() < deadline:
            if self.sidecar.ready():
                try:
                    res = on_sidecar()
                    self.gone = None
                    return res, (
                        f"sidecar: stopped answering during the restore's {what} ({first}); "
                        "it answered again and served it"
                    )
                except ProtocolError as exc:
                    first = exc
                    break
            time.sleep(self.poll_seconds)
        self.gone = first
        note = (
            f"sidecar: stopped answering during the restore's {what} ({first}); waited "
            f"{self.wait_seconds:.0f} s, then read the tiers directly"
        )
        log.warning("strata restore: %s", note)
        return locally(), note

    def inventory(self, job_id: str, rank: int, world_size: int) -> RankInventory:
        inv, note = self._call(
            "inventory",
            lambda: self.sidecar.inventory(job_id, rank, world_size),
            lambda: self.local.inventory(job_id, rank, world_size),
        )
        if note is None:
            return inv
        return dataclasses.replace(inv, notes=(note, *inv.notes))

    def stage(self, request: StageRequest) -> StageResult:
        used_local = False

        def locally() -> StageResult:
            nonlocal used_local
            used_local = True
            return self.local.stage(request)

        res, note = self._call(
            f"staging of step {request.step}",
            lambda: self.sidecar.stage(request.model_copy(update={"verify_in_place": False})),
            locally,
        )
        self.defers_in_place_verify = res.deferred_verify or (
            used_local and self.local.defers_in_place_verify
        )
        if note is not None:
            res.skipped.insert(0, note)
        return res

    def report(self, event: ClientEvent) -> None:
        """Best effort to the sidecar (never raises)."""
        self.sidecar.report(event)
