"""The trainer's side of the sidecar's local API (torch-free; used by :class:`strata.Checkpointer`).

:class:`SidecarClient` implements the client's two seams over the unix socket:

- :class:`strata.tiers.ram.SlotProvider` (``acquire_slot``): the sidecar allocates and pre-faults
  the slot files, so their tmpfs pages are charged to the sidecar's container;
- the :class:`strata.client.stager.SidecarStager` protocol (``inventory``, ``stage``, ``ready``): the sidecar lists
  the tiers and stages a shard into RAM, verifying and falling back RAM -> PVC -> GCS (with
  ``verify_in_place=False`` a RAM hit is left to the caller's one-pass load to verify:
  ``StageResult.deferred_verify``);

plus the peer tier's reads (``peer_info``, ``peer_steps``, ``peer_manifest``, ``peer_range``:
the sidecar alone holds the peers' TLS material; :mod:`strata.client.peer_source`), and
``report`` (save/restore events -> the sidecar's metrics and operator reports; best effort,
never raises). :func:`connect` returns a client only when a ready sidecar answers on the socket,
so a trainer without a sidecar (or with a stale socket file) falls back to direct tier access.

Every request and reply is a :mod:`strata.protocol` message. Errors map back to the tier
exceptions the client already handles: 507 -> ``TierFull``, 409 -> ``SlotsBusy``, 404 from stage
-> :class:`strata.errors.StageError`, 400 or a reply that is not the expected message ->
:class:`strata.errors.ProtocolError`, anything else -> ``TierError`` naming the socket and the
sidecar's message. Rule: never imports :mod:`strata.sidecar` (only the protocol).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import tenacity

from strata import protocol
from strata.errors import (
    ProtocolError,
    ShardUnavailable,
    SidecarUnavailable,
    SlotsBusy,
    StageError,
    TierError,
    TierFull,
)
from strata.protocol import (
    HEALTHZ,
    INVENTORY,
    REPORT,
    SLOTS,
    STAGE,
    STATUS,
    TERMINATE,
    ErrorReply,
    HealthReply,
    InventoryReply,
    InventoryRequest,
    Message,
    RestoreEvent,
    SaveEvent,
    SlotReply,
    SlotRequest,
    StageReply,
    StageRequest,
    StatusReply,
    TerminateReply,
    TerminateRequest,
    parse_event,
    parse_reply,
)
from strata.restore import RankInventory, StageResult

log = logging.getLogger("strata.sidecar.client")


class UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client`` over a unix socket (the trainer side of the local API)."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self) -> None:
        # A full listen backlog (the sidecar busy, many ranks calling at once) makes a unix-socket
        # connect with a timeout fail at once with EAGAIN (BlockingIOError); it is retried after
        # 10, 20, 40 ... 200 ms while the next try starts within the timeout. Other errors raise.
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(BlockingIOError),
            wait=tenacity.wait_exponential(multiplier=0.01, max=0.2),
            stop=tenacity.stop_before_delay(self.timeout if self.timeout is not None else 30.0),
            reraise=True,
        )
        self.sock = retrying(self._connect_once)

    def _connect_once(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout is not None:
            sock.settimeout(self.timeout)
        try:
            sock.connect(self._unix_path)
        except OSError:
            sock.close()
            raise
        return sock


class SidecarClient:
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
        self.defers_in_place_verify = False
        """Whether the last staging left a RAM hit unverified (the request's
        ``verify_in_place=False``, honoured by the sidecar): the caller verifies it."""

    def __repr__(self) -> str:
        return f"SidecarClient({self.socket_path!r})"

    def call(
        self,
        method: str,
        path: str,
        body: Message | None = None,
        timeout: float | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """One call: ``body`` (a :mod:`strata.protocol` request) as JSON; returns the status and
        the JSON object answered. Raises :class:`SidecarUnavailable` when nobody answers or the
        answer is cut short (the sidecar died while sending it)."""
        conn = UnixHTTPConnection(self.socket_path, timeout=timeout or self.timeout)
        try:
            payload = (
                (body.model_dump_json() if body is not None else "{}").encode()
                if method == "POST"
                else None
            )
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            # HTTPException: the sidecar died mid-answer (IncompleteRead, a bad status line)
            raise SidecarUnavailable(
                f"the Strata sidecar did not answer on {self.socket_path} ({exc}); is the sidecar "
                "container running? (the trainer falls back to direct tier access when it starts "
                "without one)"
            ) from exc
        finally:
            conn.close()
        try:
            data = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            data = ErrorReply(
                error=raw[:512].decode(errors="replace"), kind="bad_response"
            ).model_dump()
        return status, data

    def _ok(self, status: int, data: dict[str, Any], what: str) -> dict[str, Any]:
        if status == 200:
            return data
        message = f"sidecar {what} failed ({status} {data.get('kind')}): {data.get('error')}"
        if status == 400:
            raise ProtocolError(message)
        if status == 507:
            raise TierFull(message)
        if status == 409:
            raise SlotsBusy(message)
        raise TierError(message)

    # -- health -------------------------------------------------------------------------------------

    def ready(self) -> bool:
        try:
            status, data = self.call(*HEALTHZ, timeout=min(self.timeout, 2.0))
        except SidecarUnavailable:
            return False
        if status not in (200, 503):
            return False
        return parse_reply(HealthReply, data, self.socket_path).ready

    # -- SlotProvider -------------------------------------------------------------------------------

    def acquire_slot(
        self, job_id: str, rank: int, nbytes: int, exclude: Collection[Path] = ()
    ) -> Path:
        """A slot file of at least ``nbytes`` bytes, allocated by the sidecar (SlotProvider)."""
        status, data = self.call(
            *SLOTS,
            SlotRequest(job_id=job_id, rank=rank, nbytes=nbytes, exclude=[str(p) for p in exclude]),
        )
        reply = parse_reply(SlotReply, self._ok(status, data, "slot allocation"), self.socket_path)
        return Path(reply.path)

    # -- Stager -------------------------------------------------------------------------------------

    def inventory(self, job_id: str, rank: int, world_size: int) -> RankInventory:
        status, data = self.call(
            *INVENTORY,
            InventoryRequest(job_id=job_id, rank=rank, world_size=world_size),
        )
        body = self._ok(status, data, "inventory")
        return parse_reply(InventoryReply, body, self.socket_path).inventory()

    def stage(self, request: StageRequest) -> StageResult:
        """``POST /v1/stage`` (:meth:`strata.client.stager.Stager.stage`); the sidecar honours
        ``request.verify_in_place`` (the result's ``deferred_verify`` says whether it left the RAM
        hit to the caller). Raises :class:`StageError` (no tier serves),
        ``TierFull``/``SlotsBusy``/``TierError`` and :class:`ProtocolError` (see the module
        docstring)."""
        status, data = self.call(*STAGE, request, timeout=self.stage_timeout)
        if status == 404 and data.get("kind") == "stage_error":
            err = parse_reply(ErrorReply, data, self.socket_path)
            raise StageError(err.error, list(err.skipped), list(err.quarantined))
        body = self._ok(status, data, "staging")
        result = parse_reply(StageReply, body, self.socket_path).result()
        self.defers_in_place_verify = result.deferred_verify
        return result

    # -- reports ------------------------------------------------------------------------------------

    def report(self, event: SaveEvent | RestoreEvent | Mapping[str, Any]) -> None:
        """Send a save/restore event (a :data:`strata.protocol.ClientEvent`, or its fields);
        best effort: a failure is logged at debug, never raised."""
        try:
            message = event if isinstance(event, Message) else parse_event(dict(event))
        except ValueError as exc:
            log.debug("report not sent: %s", exc)
            return
        try:
            status, data = self.call(*REPORT, message, timeout=min(self.timeout, 2.0))
            if status != 200:
                log.debug("sidecar refused a report: %s", data)
        except SidecarUnavailable as exc:
            log.debug("report not delivered: %s", exc)

    # -- termination --------------------------------------------------------------------------------

    def terminate(
        self,
        job_id: str,
        rank: int,
        since_signal_seconds: float,
        wait_step: int | None = None,
        timeout: float = 0.0,
        final_save: bool = False,
    ) -> TerminateReply:
        """``POST /v1/terminate``: tell the sidecar the pod is terminating (its SIGTERM came
        ``since_signal_seconds`` ago) so that it flushes the newest committed RAM step to the
        fastest durable tier now; with ``wait_step``, block up to ``timeout`` seconds until that
        step is durable (or the flush failed). ``final_save``: a request for the final step
        will follow (the sidecar may hold its first pass a few seconds for it). Raises :class:`SidecarUnavailable`,
        :class:`TierError` or :class:`ProtocolError`."""
        status, data = self.call(
            *TERMINATE,
            TerminateRequest(
                job_id=job_id,
                rank=rank,
                since_signal_seconds=since_signal_seconds,
                wait_step=wait_step,
                timeout_seconds=timeout,
                final_save=final_save,
            ),
            timeout=timeout + max(self.timeout, 2.0),
        )
        return parse_reply(
            TerminateReply, self._ok(status, data, "termination flush"), self.socket_path
        )

    def status(self) -> StatusReply:
        status, data = self.call(*STATUS)
        return parse_reply(StatusReply, self._ok(status, data, "status"), self.socket_path)

    # -- the peer tier (read through the sidecar: it holds the peers' mTLS material) -------------

    def peer_info(self) -> protocol.PeerInfoReply | None:
        """``GET /v1/peer``: whether this sidecar reaches a peer tier; None from a sidecar
        that has no such endpoint (an older version). Raises :class:`SidecarUnavailable`,
        :class:`TierError` or :class:`ProtocolError`."""
        status, data = self.call(*protocol.PEER)
        if status == 404 and data.get("kind") == "not_found":
            return None
        body = self._ok(status, data, "peer tier probe")
        return parse_reply(protocol.PeerInfoReply, body, self.socket_path)

    def peer_steps(self, job_id: str) -> protocol.PeerStepsReply:
        """``POST /v1/peer/steps``: what the job's peers hold, by step. Raises
        :class:`ShardUnavailable` (no peer tier), :class:`TierError` or
        :class:`ProtocolError`."""
        status, data = self.call(*protocol.PEER_STEPS, protocol.JobRequest(job_id=job_id))
        body = self._peer_ok(status, data, "peer listing")
        return parse_reply(protocol.PeerStepsReply, body, self.socket_path)

    def peer_manifest(self, job_id: str, step: int, rank: int) -> bytes:
        """``POST /v1/peer/manifest``: the stored (sealed) manifest of a peer copy of ``rank``'s
        shard of ``step``, NOT parsed (the caller checks it:
        :func:`strata.tiers.base.parse_manifest`). Raises :class:`ShardUnavailable` when no
        peer serves it, :class:`TierError` or :class:`ProtocolError`."""
        request = protocol.PeerShardRequest(job_id=job_id, step=step, rank=rank)
        status, data = self.call(*protocol.PEER_MANIFEST, request)
        body = self._peer_ok(status, data, f"peer manifest of step {step} rank {rank}")
        return parse_reply(protocol.PeerManifestReply, body, self.socket_path).manifest.encode()

    def peer_range(
        self, job_id: str, step: int, rank: int, offset: int, length: int, reader: str = ""
    ) -> bytes:
        """``POST /v1/peer/range``: at most ``length`` bytes (no more than
        :attr:`PeerInfoReply.max_range`) of a peer copy's stored data object from byte
        ``offset``, unverified; fewer only where the object ends. Raises
        :class:`ShardUnavailable` when no peer serves it, :class:`SidecarUnavailable` (no
        answer, or a reply cut short), :class:`TierError` or :class:`ProtocolError` (a reply
        longer than asked). ``reader``: the reading source's id (:meth:`peer_drop`)."""
        request = protocol.PeerRangeRequest(
            job_id=job_id, step=step, rank=rank, offset=offset, length=length, reader=reader
        )
        conn = UnixHTTPConnection(self.socket_path, timeout=self.stage_timeout)
        try:
            conn.request(
                *protocol.PEER_RANGE,
                body=request.model_dump_json().encode(),
                headers={"Content-Type": "application/json"},
            )
            response = conn.getresponse()
            raw = response.read()  # http.client checks the explicit Content-Length
            status, ctype = response.status, response.getheader("Content-Type", "")
        except (OSError, http.client.HTTPException) as exc:
            raise SidecarUnavailable(
                f"the Strata sidecar on {self.socket_path} did not serve bytes {offset}+{length} "
                f"of step {step} rank {rank} from the peers ({exc!r})"
            ) from exc
        finally:
            conn.close()
        if status == 200 and ctype == "application/octet-stream":
            if len(raw) > length:
                raise ProtocolError(
                    f"the sidecar on {self.socket_path} answered {len(raw)} bytes for a range of "
                    f"{length}; the trainer's and the sidecar's Strata versions must match"
                )
            return raw
        try:
            data = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            data = {"error": raw[:512].decode(errors="replace"), "kind": "bad_response"}
        what = f"peer range of step {step} rank {rank}"
        self._peer_ok(status, data, what)  # raises unless 200
        raise ProtocolError(
            f"the sidecar on {self.socket_path} answered the {what} with {ctype or 'no'} content, "
            "not bytes; the trainer's and the sidecar's Strata versions must match"
        )

    def peer_drop(self, job_id: str, reader: str = "") -> None:
        """``POST /v1/peer/drop``: ``reader`` (the id its :meth:`peer_range` calls named) is done
        with the shards the sidecar rebuilt whole (from erasure-coded parity) to serve ranged
        reads; the sidecar removes them once no other reader of the node uses them (``""``:
        now). Best effort: never raises."""
        try:
            self.call(*protocol.PEER_DROP, protocol.PeerDropRequest(job_id=job_id, reader=reader))
        except SidecarUnavailable as exc:
            log.debug("peer drop not delivered: %s", exc)

    def _peer_ok(self, status: int, data: dict[str, Any], what: str) -> dict[str, Any]:
        """As :meth:`_ok`; 404 ``no_peers``/``shard_unavailable`` -> :class:`ShardUnavailable`."""
        if status == 404 and data.get("kind") in ("no_peers", "shard_unavailable"):
            raise ShardUnavailable(f"sidecar {what}: {data.get('error')}")
        return self._ok(status, data, what)


def connect(socket_path: str | os.PathLike[str], **kwargs: Any) -> SidecarClient | None:
    """An :class:`SidecarClient` when a ready sidecar answers on ``socket_path``, else None."""
    if not Path(socket_path).is_socket():
        return None
    client = SidecarClient(socket_path, **kwargs)
    if client.ready():
        return client
    log.warning(
        "a Strata sidecar socket exists at %s but no ready sidecar answers; using the tiers "
        "directly",
        socket_path,
    )
    return None
