"""Incarnations of a job: every restore (a fresh start included) opens one.

An incarnation is one uninterrupted run of the job's world: its id is chosen by rank 0 and agreed
by every rank in the restore all-gather, and every shard manifest it writes carries it. Its record,
``<job>/incarnations/<id>.json`` (sealed, :mod:`strata.format.sealed`), says which incarnation it
continues (``parent``: the incarnation of the step it resumed from) and from which step
(``base_step``); a fresh start has neither, and supersedes every earlier incarnation.

Which steps are live (:class:`Lineage`): follow ``parent`` links back from the newest
incarnation. The newest one's steps are all live; an ancestor's steps are live up to the
``base_step`` its successor on the chain resumed from; nothing else is. So a step of a superseded
incarnation above its successor's resume point (a run that went on after the step the job was
restored from, whose later steps the replay rewrites) is never restorable, never counts as
newest for retention and never sets a promotion interval, and neither is any step of an
incarnation off the chain (an earlier run of the same job id that the newest one did not resume).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from strata.format.layout import INCARNATION_ID_RE
from strata.format.manifest import FORMAT_VERSION
from strata.format.sealed import SealedRecord


def new_incarnation_id(now: datetime | None = None) -> str:
    """A fresh id, ordered by creation time: ``'20261201T021700123456Z-1a2b3c4d'``."""
    t = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{t:%Y%m%dT%H%M%S%fZ}-{secrets.token_hex(4)}"


class Incarnation(SealedRecord):
    """The record of incarnation ``id`` of job ``job_id``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    record_kind: ClassVar[str] = "incarnation record"
    format: Literal["strata-incarnation"] = "strata-incarnation"
    format_version: int = FORMAT_VERSION
    job_id: str
    id: str
    parent: str | None = None
    """Incarnation of the step this one resumed from; None for a fresh start, or (with a
    ``base_step``) for a step written outside any incarnation (``""``)."""
    base_step: Annotated[int, Field(ge=0)] | None = None
    """The step it resumed from; None for a fresh start."""
    world_size: Annotated[int, Field(ge=1)]
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @field_validator("id", "parent")
    @classmethod
    def _safe_id(cls, v: str | None) -> str | None:
        if v is not None and not INCARNATION_ID_RE.match(v):
            raise ValueError(f"incarnation id {v!r} is not 1-64 characters of [0-9A-Za-z._-]")
        return v


class Lineage:
    """Which (incarnation, step) pairs are live, from a job's incarnation records.

    ``current``: the incarnation to follow back from; default: the newest record (by ``created``,
    then id). With no records at all every step is live (shards written outside incarnations).
    A record naming a parent without a record of its own still links to it.
    """

    def __init__(self, records: Iterable[Incarnation], current: str | None = None) -> None:
        self.records = {r.id: r for r in records}
        if current is None and self.records:
            current = max(self.records.values(), key=lambda r: (r.created, r.id)).id
        self.current = current
        self.limits: dict[str, int | None] = {}
        """incarnation id -> newest live step (None: no limit) for each incarnation on the chain."""
        inc, limit = current, None
        while inc is not None and inc not in self.limits:
            self.limits[inc] = limit
            rec = self.records.get(inc)
            if rec is None or rec.base_step is None:
                break
            limit = rec.base_step if limit is None else min(limit, rec.base_step)
            # A parent of None with a base step: it resumed from shards of no incarnation ("").
            inc = rec.parent if rec.parent is not None else ""

    def live(self, incarnation: str, step: int) -> bool:
        """Step ``step`` written by ``incarnation`` may be restored / promoted / kept as newest."""
        if self.current is None:
            return True
        if incarnation not in self.limits:
            return False
        limit = self.limits[incarnation]
        return limit is None or step <= limit

    def why_dead(self, incarnation: str, step: int) -> str:
        """A sentence for logs and reports on why :meth:`live` is False ('' when it is True)."""
        if self.live(incarnation, step):
            return ""
        if incarnation not in self.limits:
            return (
                f"step {step} belongs to incarnation {incarnation!r}, which the current "
                f"incarnation {self.current!r} does not descend from"
            )
        return (
            f"step {step} of incarnation {incarnation!r} lies above step {self.limits[incarnation]} "
            "that a later incarnation resumed from (superseded)"
        )
