"""The trainer <-> sidecar protocol: typed messages of the sidecar's local API.

Both ends use these models: the trainer's :class:`strata.client.sidecar_client.SidecarClient`
builds requests and parses replies with them, the sidecar's
:class:`strata.sidecar.local_api.LocalApi` parses requests and builds replies with them. The wire
format is JSON over HTTP on a unix socket (``StrataConfig.socket``); the endpoints:

=====================  ========================  ==================================
endpoint               request                   reply (200)
=====================  ========================  ==================================
``GET  /healthz``      --                        :class:`HealthReply` (503 before ready)
``POST /v1/slots``     :class:`SlotRequest`      :class:`SlotReply`
``POST /v1/inventory`` :class:`InventoryRequest` :class:`InventoryReply`
``POST /v1/stage``     :class:`StageRequest`     :class:`StageReply`
``POST /v1/report``    :class:`ClientEvent`      :class:`ReportReply`
``GET  /v1/status``    --                        :class:`StatusReply`
``POST /v1/terminate`` :class:`TerminateRequest` :class:`TerminateReply`
=====================  ========================  ==================================

The peer tier, read through the sidecar (it alone holds the peers' mTLS material), for the
trainer's resharding reads (:class:`strata.client.peer_source.PeerSource`):

=========================  ==========================  ====================================
endpoint                   request                     reply (200)
=========================  ==========================  ====================================
``GET  /v1/peer``          --                          :class:`PeerInfoReply`
``POST /v1/peer/steps``    :class:`JobRequest`         :class:`PeerStepsReply`
``POST /v1/peer/manifest`` :class:`PeerShardRequest`   :class:`PeerManifestReply`
``POST /v1/peer/range``    :class:`PeerRangeRequest`   the bytes (``application/octet-stream``)
``POST /v1/peer/drop``     :class:`PeerDropRequest`    :class:`ReportReply`
=========================  ==========================  ====================================

Without a peer tier all but the first answer 404 ``no_peers``; a shard no peer serves is 404
``shard_unavailable``; a range longer than :attr:`PeerInfoReply.max_range` is 400.

Any other status carries an :class:`ErrorReply` whose ``kind`` says what happened
(``bad_request`` 400, ``wrong_job`` 403, ``stage_error`` 404, ``slots_busy`` 409,
``tier_full`` 507, ``tier_error`` 500/507, ``internal`` 500).

Fields a newer peer adds are ignored (``extra="ignore"``) so that a trainer image and a sidecar
image of neighbouring versions still talk; a missing or mistyped field is a 400 naming it.
Rule: this module imports only the format and the restore data types; both the client and the
sidecar import it, it imports neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from strata.errors import ProtocolError
from strata.format.manifest import Manifest
from strata.restore.plan import RankInventory
from strata.restore.staging import StageResult

NonNegative = Annotated[int, Field(ge=0)]
M = TypeVar("M", bound=BaseModel)


class Endpoint(NamedTuple):
    """One route of the local API (the table in the module docstring), used by both ends:
    ``client.call(*STAGE, request)``, ``routes.add(*STAGE, handler)``."""

    method: Literal["GET", "POST"]
    path: str


HEALTHZ = Endpoint("GET", "/healthz")
SLOTS = Endpoint("POST", "/v1/slots")
INVENTORY = Endpoint("POST", "/v1/inventory")
STAGE = Endpoint("POST", "/v1/stage")
REPORT = Endpoint("POST", "/v1/report")
STATUS = Endpoint("GET", "/v1/status")
TERMINATE = Endpoint("POST", "/v1/terminate")
PEER = Endpoint("GET", "/v1/peer")
PEER_STEPS = Endpoint("POST", "/v1/peer/steps")
PEER_MANIFEST = Endpoint("POST", "/v1/peer/manifest")
PEER_RANGE = Endpoint("POST", "/v1/peer/range")
PEER_DROP = Endpoint("POST", "/v1/peer/drop")


class Message(BaseModel):
    """Base of every message (immutable; unknown fields ignored, see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class JobRequest(Message):
    """Every request names the job; the sidecar refuses another job's id (403 ``wrong_job``)."""

    job_id: str


# -- health and status --------------------------------------------------------------------------


class HealthReply(Message):
    ready: bool


class StatusReply(Message):
    """The promotion engine's view of this pod."""

    job_id: str
    ready: bool
    local_ranks: list[int]
    ram_step: int | None
    """Newest step committed in RAM for every local rank."""
    promoted: dict[str, int | None]
    """Durable tier -> newest step this sidecar promoted there (or found at start)."""
    flush_estimate: dict[str, Any] | None = None
    """:class:`strata.reports.FlushEstimate` as JSON: whether a termination flush of the
    current state fits the grace period (None: no promotion measured yet)."""


# -- slots -------------------------------------------------------------------------------------


class SlotRequest(JobRequest):
    """A RAM slot of rank ``rank`` holding at least ``nbytes`` bytes, not one of ``exclude``
    (paths of slots the trainer failed to lock)."""

    rank: NonNegative
    nbytes: NonNegative
    exclude: list[str] = []


class SlotReply(Message):
    path: str


# -- restore -------------------------------------------------------------------------------------


class InventoryRequest(JobRequest):
    rank: NonNegative
    world_size: Annotated[int, Field(ge=1)]


class InventoryReply(Message):
    """:class:`strata.restore.plan.RankInventory` on the wire: tier -> step -> ranks."""

    rank: int
    world_size: int
    committed: dict[str, dict[int, list[int]]]
    partial: dict[str, dict[int, list[int]]] = {}
    notes: list[str] = []
    incarnations: dict[str, dict[int, str]] = {}
    records: list[dict[str, Any]] = []
    unusable: dict[str, list[int]] = {}

    @classmethod
    def of(cls, inventory: RankInventory) -> InventoryReply:
        return cls.model_validate(inventory.to_dict())

    def inventory(self) -> RankInventory:
        return RankInventory.from_dict(self.model_dump())


class StageRequest(JobRequest):
    """Stage rank ``rank``'s shard of ``step`` into RAM from ``sources`` (tier names, nearest
    first; None: every tier)."""

    step: NonNegative
    rank: NonNegative
    world_size: Annotated[int, Field(ge=1)]
    sources: list[str] | None = None
    verify_in_place: bool = True
    """False: the client verifies a RAM hit while it loads it (one pass over the shard instead
    of the sidecar's checksum pass followed by the client's copy); the reply's
    ``deferred_verify`` says whether the sidecar left it to the client (a sidecar without this
    field ignores it and verifies)."""


class StageReply(Message):
    """:class:`strata.restore.staging.StageResult` on the wire."""

    tier: str
    path: str
    manifest: Manifest
    nbytes: int
    seconds: float
    skipped: list[str] = []
    quarantined: list[str] = []
    """Tiers whose copy failed verification and was quarantined on the way."""
    deferred_verify: bool = False
    """True: ``path`` is a RAM hit the sidecar did NOT verify (``verify_in_place=False``); the
    client must verify it while loading it and quarantine it on a mismatch."""

    @classmethod
    def of(cls, result: StageResult) -> StageReply:
        return cls.model_validate({**vars(result), "path": str(result.path)})

    def result(self) -> StageResult:
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return StageResult(**{**fields, "path": Path(self.path)})


# -- client events -------------------------------------------------------------------------------


class SaveEvent(JobRequest):
    """A save by the trainer: ``ok`` with its stall (seconds the training loop was blocked), or
    the error that made it fail."""

    kind: Literal["save"] = "save"
    rank: NonNegative | None = None
    step: NonNegative
    ok: bool = True
    stall_seconds: Annotated[float, Field(ge=0)] | None = None
    error: str | None = None


class RestoreEvent(JobRequest):
    """A restore by the trainer: which step, from which tier, how long it took."""

    kind: Literal["restore"] = "restore"
    rank: NonNegative | None = None
    step: NonNegative | None = None
    tier: str | None = None
    nbytes: NonNegative = 0
    seconds: Annotated[float, Field(ge=0)] = 0.0
    outcome: Literal["restored", "fresh-start", "failed"] = "restored"
    skipped: list[str] = []
    quarantined: list[str] = []
    """Tiers whose copy the trainer's own load found corrupt and quarantined (a RAM hit the
    sidecar left to it, ``StageReply.deferred_verify``); the sidecar counts each as a checksum
    mismatch, as it does for the copies its staging quarantines."""


ClientEvent = Annotated[SaveEvent | RestoreEvent, Field(discriminator="kind")]
"""What ``POST /v1/report`` carries (``kind``: ``save`` or ``restore``)."""

client_event: TypeAdapter[SaveEvent | RestoreEvent] = TypeAdapter(ClientEvent)


class ReportReply(Message):
    accepted: bool


# -- termination -----------------------------------------------------------------------------------


class TerminateRequest(JobRequest):
    """The pod is terminating (the trainer got SIGTERM): flush to the fastest durable tier now.

    A native sidecar gets its own SIGTERM only after the trainer exited, so the trainer's
    request is the sidecar's first notice. ``since_signal_seconds``: how long ago the trainer
    got the signal (the pod's grace period runs from then). ``wait_step``: None: start the
    flush of the newest committed RAM step and answer at once (the notice); a step: answer
    when that step (or a newer one) is durable, when the flush failed, or after
    ``timeout_seconds``."""

    rank: NonNegative
    since_signal_seconds: Annotated[float, Field(ge=0)] = 0.0
    wait_step: NonNegative | None = None
    timeout_seconds: Annotated[float, Field(ge=0)] = 0.0
    final_save: bool = False
    """The trainer's loop polls ``should_stop`` and will request its final step soon: the
    sidecar may hold the first pass for it a few seconds (a notice without it never waits)."""


class TerminateReply(Message):
    """Where the termination flush stands (:class:`strata.sidecar.termination.FlushOutcome`)."""

    started: bool
    """A flush is running or ran since the notice."""
    done: bool
    """The last flush finished and no other is pending."""
    ok: bool | None = None
    """The last finished flush's outcome (None: none finished yet)."""
    fit: bool | None = None
    """It finished before the deadline (None: none finished yet)."""
    tier: str | None = None
    durable_step: int | None = None
    """Newest local step on the fastest durable tier after the last flush."""
    seconds: float | None = None
    """Wall time of the last flush."""
    deadline_in_seconds: float
    """Seconds left until the flush deadline (grace period minus the sidecar's margin)."""
    message: str = ""


# -- errors ---------------------------------------------------------------------------------------


class ErrorReply(Message):
    """The body of every non-200 reply."""

    error: str
    kind: str
    skipped: list[str] = []
    """``stage_error`` only: why each tier did not serve."""
    quarantined: list[str] = []
    """``stage_error`` only: tiers whose copy was quarantined."""


def parse(model: type[M], body: Any, what: str) -> M:
    """Validate ``body`` as ``model``; :class:`ValueError` naming every bad field otherwise
    (the local API turns it into a 400, the client into a :class:`ProtocolError`)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ValueError(f"{what}: {describe(exc)}") from None


def parse_event(body: Any) -> SaveEvent | RestoreEvent:
    """Validate a ``/v1/report`` body; :class:`ValueError` naming the bad fields otherwise."""
    try:
        return client_event.validate_python(body)
    except ValidationError as exc:
        raise ValueError(f"client event: {describe(exc)}") from None


def parse_reply(model: type[M], body: Any, socket: str) -> M:
    """Validate a reply from the sidecar; :class:`ProtocolError` naming the socket otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ProtocolError(
            f"the sidecar on {socket} answered an unexpected {model.__name__} ({describe(exc)}); "
            "the trainer's and the sidecar's Strata versions must match"
        ) from None


def describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<body>'}: {err['msg']}" for err in exc.errors()
    )


# -- the peer tier through the sidecar ------------------------------------------------------------


class PeerInfoReply(Message):
    """Whether this sidecar reaches a peer tier; ``max_range``: the most bytes one
    ``/v1/peer/range`` answers (:data:`strata.peers.wire.MAX_RANGE`)."""

    enabled: bool
    max_range: Annotated[int, Field(ge=1)]


class PeerStep(Message):
    """What the peers hold of one step (:class:`strata.tiers.base.StepListing`)."""

    step: NonNegative
    committed_ranks: list[NonNegative]
    world_size: Annotated[int, Field(ge=1)] | None = None


class PeerStepsReply(Message):
    steps: list[PeerStep]
    notes: list[str] = []
    """Why steps or ranks are not restorable from the peers (unreachable, beyond tolerance)."""


class PeerShardRequest(JobRequest):
    step: NonNegative
    rank: NonNegative


class PeerManifestReply(Message):
    manifest: str
    """The manifest's stored form (sealed JSON, :meth:`Manifest.to_json`): the trainer checks
    its seal and identity as it does for every tier's."""


class PeerRangeRequest(PeerShardRequest):
    """Bytes ``[offset, offset + length)`` of the shard's stored data object, unverified (the
    trainer checks them against the manifest's chunk CRC32Cs)."""

    offset: NonNegative
    length: Annotated[int, Field(ge=1)]
    reader: str = ""
    """The reading :class:`strata.client.peer_source.PeerSource` (an opaque id, unique per
    process and source): the sidecar keeps the shards it rebuilt for ranged reads until every
    reader that read since the last removal dropped them (:class:`PeerDropRequest`)."""


class PeerDropRequest(JobRequest):
    """``reader`` is done with the shards the sidecar rebuilt whole for ranged reads: they are
    removed once no other reader of this node is using them. ``""`` (a client of an older
    version): removed now."""

    reader: str = ""
