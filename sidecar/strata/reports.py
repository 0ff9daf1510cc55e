"""Report schema: what a sidecar pushes to the operator (docs/architecture.md "Reports").

The sidecar POSTs one :class:`SidecarReport` as JSON to ``<report endpoint>/v1/reports`` with
``Authorization: Bearer <projected service-account token>``. The operator validates it with this
same model, authenticates the token with a TokenReview, checks that the pod belongs to the policy,
and folds it into ``CheckpointPolicy.status.jobs[]``, Events and metrics.

Reports are small (bounded lists) and best-effort: losing one never affects checkpointing.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from strata.config import SourceName, TierName
from strata.constants import REPORT_PATH as REPORT_PATH

REPORT_VERSION: Literal[1] = 1
MAX_EVENTS = 16


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TierState(_Model):
    """What one tier holds for this job, as seen by the reporting sidecar."""

    newest_complete_step: Annotated[int, Field(ge=0)] | None = None
    """Newest step whose every rank manifest is committed in this tier."""
    newest_committed_step: Annotated[int, Field(ge=0)] | None = None
    """Newest step with at least one of this pod's shards committed in this tier."""
    complete_steps: Annotated[int, Field(ge=0)] = 0
    too_small: Annotated[str, Field(max_length=1024)] | None = None
    """Set while the tier cannot take ``keep + 1`` steps (a step failed with no space left while
    the tier held no more than ``keep`` complete older steps, so retention can free nothing and
    promotion to it has stopped advancing): what was needed and what the tier has. The operator
    shows it in the policy status."""


class Promotion(_Model):
    tier: TierName
    step: Annotated[int, Field(ge=0)]
    bytes: Annotated[int, Field(ge=0)]
    seconds: Annotated[float, Field(ge=0)]
    time: datetime = Field(default_factory=utcnow)


class Restore(_Model):
    """A restore's provenance: which tier served which step, and why nearer tiers were skipped."""

    tier: SourceName | None
    """None: nothing restorable (fresh start or failure, see ``outcome``); ``peer``: other
    nodes' RAM (docs/peers.md)."""
    step: Annotated[int, Field(ge=0)] | None
    bytes: Annotated[int, Field(ge=0)] = 0
    seconds: Annotated[float, Field(ge=0)] = 0.0
    outcome: Literal["restored", "fresh-start", "failed"] = "restored"
    skipped: Annotated[list[str], Field(max_length=MAX_EVENTS)] = []
    rank: Annotated[int, Field(ge=0)] | None = None
    time: datetime = Field(default_factory=utcnow)


class ReportedError(_Model):
    tier: SourceName | None = None
    message: Annotated[str, Field(max_length=2048)]
    time: datetime = Field(default_factory=utcnow)


class FlushEstimate(_Model):
    """Whether a termination flush of the current state fits in the pod's grace period.

    ``seconds_needed`` = ``state_bytes`` / ``bytes_per_second``: the local shards of the newest
    step promoted to the fastest durable tier over the throughput measured on the recent
    promotions to it (bytes written / wall seconds, under whatever load the node had).
    ``budget_seconds``: the grace period minus the sidecar's margin for its last report and exit.
    ``fits`` is None until a promotion was measured. ``last_*``: the newest termination flush
    this sidecar ran (None: none yet); ``last_fit`` False means the flush did not finish before
    the deadline (or failed), so the step it was flushing may not be durable.
    """

    tier: TierName | None = None
    state_bytes: Annotated[int, Field(ge=0)] | None = None
    bytes_per_second: Annotated[float, Field(ge=0)] | None = None
    seconds_needed: Annotated[float, Field(ge=0)] | None = None
    grace_seconds: Annotated[float, Field(gt=0)]
    budget_seconds: Annotated[float, Field(ge=0)]
    fits: bool | None = None
    last_ok: bool | None = None
    last_fit: bool | None = None
    last_step: Annotated[int, Field(ge=0)] | None = None
    last_seconds: Annotated[float, Field(ge=0)] | None = None


class SidecarReport(_Model):
    version: Literal[1] = REPORT_VERSION
    policy: Annotated[str, Field(min_length=1, max_length=253)]
    namespace: Annotated[str, Field(min_length=1, max_length=63)]
    pod_name: Annotated[str, Field(min_length=1, max_length=253)]
    pod_uid: str | None = None
    job_id: Annotated[str, Field(min_length=1, max_length=512)]
    time: datetime = Field(default_factory=utcnow)
    tiers: dict[TierName, TierState] = {}
    promotions: Annotated[list[Promotion], Field(max_length=MAX_EVENTS)] = []
    restores: Annotated[list[Restore], Field(max_length=MAX_EVENTS)] = []
    errors: Annotated[list[ReportedError], Field(max_length=MAX_EVENTS)] = []
    flush: FlushEstimate | None = None
    """Termination flush estimate and outcome (:class:`FlushEstimate`); None from sidecars that
    measured nothing yet."""
