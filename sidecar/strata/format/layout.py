"""Checkpoint layout, identical in every tier (docs/architecture.md "Layout").

``<tier root>/<job id>/steps/<step:012d>/rank-<rank:05d>.data``      tensor bytes
``<tier root>/<job id>/steps/<step:012d>/rank-<rank:05d>.manifest``  written after the data
``<tier root>/<job id>/steps/<step:012d>/commit.json``  global commit record, written LAST, after
every rank's shard of one incarnation is committed in that tier (PVC, GCS; not RAM)
``<tier root>/<job id>/incarnations/<id>.json``  one record per incarnation of the job

The RAM tier also holds each rank's ring of pre-allocated slot files (the step's ``.data`` is a
hard link to one of them):

``<ram root>/<job id>/slots/rank-<rank:05d>/slot-<k>``

Paths here are relative, '/'-separated keys, usable as POSIX sub-paths and GCS object names.
"""

from __future__ import annotations

import re

STEP_DIGITS = 12
RANK_DIGITS = 5
DATA_SUFFIX = ".data"
MANIFEST_SUFFIX = ".manifest"
QUARANTINE_SUFFIX = ".quarantined"
COMMIT_NAME = "commit.json"
INCARNATION_SUFFIX = ".json"

_SHARD_RE = re.compile(r"^rank-(\d{5})\.(data|manifest)$")
_STEP_RE = re.compile(r"^\d{12}$")
_RANK_DIR_RE = re.compile(r"^rank-(\d+)$")
_SLOT_RE = re.compile(r"^slot-(\d+)$")
INCARNATION_ID_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,63}$")
"""An incarnation id: 1-64 characters of ``[0-9A-Za-z._-]``, not starting with a punctuation mark
(safe as a file name and a GCS object name component)."""


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step}")
    return f"{step:0{STEP_DIGITS}d}"


def steps_prefix(job_id: str) -> str:
    return f"{job_id}/steps"


def step_key(job_id: str, step: int) -> str:
    return f"{job_id}/steps/{step_name(step)}"


def shard_stem(rank: int) -> str:
    if rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank}")
    return f"rank-{rank:0{RANK_DIGITS}d}"


def data_key(job_id: str, step: int, rank: int) -> str:
    return f"{step_key(job_id, step)}/{shard_stem(rank)}{DATA_SUFFIX}"


def manifest_key(job_id: str, step: int, rank: int) -> str:
    return f"{step_key(job_id, step)}/{shard_stem(rank)}{MANIFEST_SUFFIX}"


def commit_key(job_id: str, step: int) -> str:
    """``<job>/steps/<step>/commit.json``: the step's global commit record in a tier."""
    return f"{step_key(job_id, step)}/{COMMIT_NAME}"


def incarnations_prefix(job_id: str) -> str:
    """``<job>/incarnations``: one record per incarnation of the job."""
    return f"{job_id}/incarnations"


def incarnation_key(job_id: str, incarnation: str) -> str:
    """``<job>/incarnations/<id>.json``; ``ValueError`` for an id that is not a safe name."""
    if not INCARNATION_ID_RE.match(incarnation):
        raise ValueError(f"incarnation id {incarnation!r} is not 1-64 characters of [0-9A-Za-z._-]")
    return f"{incarnations_prefix(job_id)}/{incarnation}{INCARNATION_SUFFIX}"


def parse_incarnation_name(name: str) -> str | None:
    """``'20261201T021700Z-1a2b3c4d.json'`` -> the id; anything else -> None."""
    if not name.endswith(INCARNATION_SUFFIX):
        return None
    stem = name[: -len(INCARNATION_SUFFIX)]
    return stem if INCARNATION_ID_RE.match(stem) else None


def parse_step(name: str) -> int | None:
    """``'000000000100'`` -> 100; anything else -> None."""
    return int(name) if _STEP_RE.match(name) else None


def parse_shard(name: str) -> tuple[int, str] | None:
    """``'rank-00003.manifest'`` -> (3, 'manifest'); anything else -> None."""
    m = _SHARD_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def slots_prefix(job_id: str) -> str:
    """``<job>/slots``: the RAM tier's slot rings of every rank of the job."""
    return f"{job_id}/slots"


def rank_slots_key(job_id: str, rank: int) -> str:
    """``<job>/slots/rank-RRRRR``: the slot files of one rank."""
    return f"{slots_prefix(job_id)}/{shard_stem(rank)}"


def slot_name(k: int) -> str:
    """``3`` -> ``'slot-3'``."""
    return f"slot-{k}"


def parse_slot(name: str) -> int | None:
    """``'slot-3'`` -> 3; anything else -> None."""
    m = _SLOT_RE.match(name)
    return int(m.group(1)) if m else None


def parse_rank_dir(name: str) -> int | None:
    """``'rank-00003'`` (a rank's slot directory) -> 3; anything else -> None."""
    m = _RANK_DIR_RE.match(name)
    return int(m.group(1)) if m else None
