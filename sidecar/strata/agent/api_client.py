"""The trainer's side of the sidecar's local API (torch-free; used by :class:`strata.Checkpointer`).

:class:`AgentClient` implements the client's two seams over the unix socket:

- :class:`strata.tiers.ram.SlotProvider` (``acquire_slot``): the sidecar allocates and pre-faults
  the slot files, so their tmpfs pages are charged to the sidecar's container;
- the ``Stager`` protocol of :mod:`strata.client` (``inventory``, ``stage``): the sidecar lists
  the tiers and stages a shard into RAM, verifying and falling back RAM -> PVC -> GCS;

plus ``report`` (save/restore events -> the sidecar's metrics and operator reports; best effort,
never raises). :func:`connect` returns a client only when a ready sidecar answers on the socket,
so a trainer without a sidecar (or with a stale socket file) falls back to direct tier access.

Errors map back to the tier exceptions the client already handles: 507 -> ``TierFull``,
409 -> ``SlotsBusy``, 404 from stage -> :class:`strata.restore.StageError`, anything else ->
``TierError`` naming the socket and the sidecar's message.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from strata.agent.http import UnixHTTPConnection
from strata.manifest import Manifest
from strata.restore import RankInventory, StageError, StageResult
from strata.tiers.base import TierError, TierFull
from strata.tiers.ram import SlotsBusy

log = logging.getLogger("strata.agent.client")


class AgentUnavailable(TierError):
    """The sidecar did not answer on its socket."""


class AgentClient:
    """JSON calls to the sidecar on ``socket_path``; ``timeout``: seconds per call (staging a
    large shard from GCS can take minutes, so ``stage`` uses ``stage_timeout``)."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        timeout: float = 30.0,
        stage_timeout: float = 3600.0,
    ) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout
        self.stage_timeout = stage_timeout

    def __repr__(self) -> str:
        return f"AgentClient({self.socket_path!r})"

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, dict[str, Any]]:
        conn = UnixHTTPConnection(self.socket_path, timeout=timeout or self.timeout)
        try:
            payload = json.dumps(body or {}).encode() if method == "POST" else None
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        except OSError as exc:
            raise AgentUnavailable(
                f"the Strata sidecar did not answer on {self.socket_path} ({exc}); is the sidecar "
                "container running? (the trainer falls back to direct tier access when it starts "
                "without one)"
            ) from exc
        finally:
            conn.close()
        try:
            data = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            data = {"error": raw[:512].decode(errors="replace"), "kind": "bad_response"}
        return status, data

    def _ok(self, status: int, data: dict[str, Any], what: str) -> dict[str, Any]:
        if status == 200:
            return data
        message = f"sidecar {what} failed ({status} {data.get('kind')}): {data.get('error')}"
        if status == 507:
            raise TierFull(message)
        if status == 409:
            raise SlotsBusy(message)
        raise TierError(message)

    # -- health -------------------------------------------------------------------------------------

    def ready(self) -> bool:
        try:
            status, data = self.call("GET", "/healthz", timeout=min(self.timeout, 2.0))
        except AgentUnavailable:
            return False
        return status == 200 and bool(data.get("ready"))

    # -- SlotProvider -------------------------------------------------------------------------------

    def acquire_slot(
        self, job_id: str, rank: int, nbytes: int, exclude: Collection[Path] = ()
    ) -> Path:
        """A slot file of at least ``nbytes`` bytes, allocated by the sidecar (SlotProvider)."""
        status, data = self.call(
            "POST",
            "/v1/slots",
            {
                "job_id": job_id,
                "rank": rank,
                "nbytes": nbytes,
                "exclude": [str(p) for p in exclude],
            },
        )
        return Path(self._ok(status, data, "slot allocation")["path"])

    # -- Stager -------------------------------------------------------------------------------------

    def inventory(self, job_id: str, rank: int, world_size: int) -> RankInventory:
        status, data = self.call(
            "POST", "/v1/inventory", {"job_id": job_id, "rank": rank, "world_size": world_size}
        )
        return RankInventory.from_dict(self._ok(status, data, "inventory"))

    def stage(
        self,
        job_id: str,
        step: int,
        rank: int,
        world_size: int,
        sources: Sequence[str] | None = None,
    ) -> StageResult:
        status, data = self.call(
            "POST",
            "/v1/stage",
            {
                "job_id": job_id,
                "step": step,
                "rank": rank,
                "world_size": world_size,
                "sources": list(sources) if sources is not None else None,
            },
            timeout=self.stage_timeout,
        )
        if status == 404 and data.get("kind") == "stage_error":
            raise StageError(str(data.get("error")), [str(s) for s in data.get("skipped", [])])
        data = self._ok(status, data, "staging")
        return StageResult(
            tier=data["tier"],
            path=Path(data["path"]),
            manifest=Manifest.model_validate(data["manifest"]),
            nbytes=int(data["nbytes"]),
            seconds=float(data["seconds"]),
            skipped=list(data.get("skipped", [])),
        )

    # -- reports ------------------------------------------------------------------------------------

    def report(self, event: dict[str, Any]) -> None:
        """Send a save/restore event; best effort (a failure is logged at debug, never raised)."""
        try:
            status, data = self.call("POST", "/v1/report", event, timeout=min(self.timeout, 2.0))
            if status != 200:
                log.debug("sidecar refused a report: %s", data)
        except AgentUnavailable as exc:
            log.debug("report not delivered: %s", exc)

    def status(self) -> dict[str, Any]:
        status, data = self.call("GET", "/v1/status")
        return self._ok(status, data, "status")


def connect(socket_path: str | os.PathLike[str], **kwargs: Any) -> AgentClient | None:
    """An :class:`AgentClient` when a ready sidecar answers on ``socket_path``, else None."""
    if not Path(socket_path).is_socket():
        return None
    client = AgentClient(socket_path, **kwargs)
    if client.ready():
        return client
    log.warning(
        "a Strata sidecar socket exists at %s but no ready sidecar answers; using the tiers "
        "directly",
        socket_path,
    )
    return None
