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

A record also carries its chain (``ancestors``: each earlier incarnation on it -> the newest step
of it that stays live), so the lineage follows from the newest record alone and older records
are redundant: a job restored 600 times does not need 600 records read per restore, and a tier
keeps only its newest few (:func:`strata.tiers.records.collect_incarnations`). Records written
before ``ancestors`` existed (None) are walked link by link as before.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
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
    ancestors: dict[str, Annotated[int, Field(ge=0)]] | None = None
    """This incarnation's chain when it opened, nearest first: each earlier incarnation on it ->
    the newest of its steps that stays live (``""``: shards written outside any incarnation); ``{}`` for a
    fresh start. None: not recorded (a record of an older version; its chain is walked through
    the parents' records)."""

    @field_validator("id", "parent")
    @classmethod
    def _safe_id(cls, v: str | None) -> str | None:
        if v is not None and not INCARNATION_ID_RE.match(v):
            raise ValueError(f"incarnation id {v!r} is not 1-64 characters of [0-9A-Za-z._-]")
        return v

    @field_validator("ancestors")
    @classmethod
    def _safe_ancestors(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        for a in v or {}:
            if a and not INCARNATION_ID_RE.match(a):
                raise ValueError(f"ancestor id {a!r} is not 1-64 characters of [0-9A-Za-z._-]")
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
        """incarnation id -> newest live step (None: no limit) for each incarnation on the chain,
        in chain order (``current`` first, then back through its ancestors)."""
        inc, limit = current, None
        while inc is not None and inc not in self.limits:
            self.limits[inc] = limit
            rec = self.records.get(inc)
            if rec is None or rec.base_step is None:
                break
            limit = rec.base_step if limit is None else min(limit, rec.base_step)
            if rec.ancestors is not None:  # the rest of the chain, as it stood when rec opened
                for a, newest in rec.ancestors.items():
                    self.limits.setdefault(a, min(newest, limit))
                break
            # A parent of None with a base step: it resumed from shards of no incarnation ("").
            inc = rec.parent if rec.parent is not None else ""

    def ancestry(self, parent: str | None, base_step: int | None) -> dict[str, int]:
        """``ancestors`` for the record of a new incarnation resuming from step ``base_step``
        of ``parent`` (None with a step: shards of no incarnation; no step: a fresh start,
        ``{}``), from these records: the chain followed back from ``parent``, each limit capped
        at ``base_step``."""
        if base_step is None:
            return {}
        p = parent if parent is not None else ""
        if p in self.limits:
            # On this chain (a live step's incarnation): p's own chain is the part of this one
            # from p back, whether or not p's record is still there (it may have been collected);
            # capping at base_step (<= p's limit here) removes the caps of p's successors.
            chain = list(self.limits)
            back = {a: self.limits[a] for a in chain[chain.index(p) :]}
        else:
            back = Lineage(self.records.values(), p).limits
        return {a: base_step if n is None else min(n, base_step) for a, n in back.items()}

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


def chain_back(
    records: Mapping[str, Incarnation], start: str | None
) -> tuple[list[Incarnation], bool]:
    """The records (id -> record) of ``start`` and its ancestors, newest first, up to the first
    that carries its own chain (``ancestors``) or is a fresh start; and whether the chain ends
    there (True) rather than at a record missing from ``records`` (False)."""
    out: list[Incarnation] = []
    seen: set[str] = set()
    inc = start
    while inc is not None and inc in records and inc not in seen:
        seen.add(inc)
        rec = records[inc]
        out.append(rec)
        if rec.ancestors is not None or rec.base_step is None:
            return out, True
        inc = rec.parent if rec.parent is not None else ""
    return out, False


def sufficient(records: Iterable[Incarnation]) -> list[Incarnation]:
    """The fewest of ``records`` whose :class:`Lineage` is that of all of them: the newest and
    its chain back to the first record that carries its own (``ancestors``), newest first; all
    of them when that chain reaches no such record (records of an older version, walked link by
    link, may need records of any tier). What a rank ships in its restore inventory: one record
    per tier in the common case, however many restores the job has had."""
    recs = {r.id: r for r in records}
    if not recs:
        return []
    newest = max(recs.values(), key=lambda r: (r.created, r.id))
    out, complete = chain_back(recs, newest.id)
    return out if complete else list(recs.values())
