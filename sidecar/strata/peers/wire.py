"""What peers exchange (JSON over mutual TLS): inventories and parity records. No I/O here.

A peer's **inventory** (``GET /v1/inventory``) lists what it can serve: the committed, checksummed
shards of its own RAM tier, the replicas it holds for other peers, and the steps it holds parity
for. A **parity record** (``GET /v1/parity/<step>/record``) describes one holder's parity file of
one step: for every column it coded, the group and the parity block number, where the chunk lies
in the file and its CRC32C; plus every member's unit layout and the raw manifests of the members'
shards, so that a shard can be rebuilt -- and verified -- after its node and its manifest are gone.

A member's **unit** is its ranks' data objects of one step laid end to end in rank order, each
starting at a multiple of ``chunk_size`` (the manifests' chunk size): unit chunk ``c`` is then one
manifest chunk of one rank (or zeros), verifiable against that manifest's ``chunk_crc32c``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from strata.format.manifest import Manifest

WIRE_VERSION = 1
MAX_RANGE = 64 * 1024 * 1024
"""Most bytes one ``GET .../data?offset=&length=`` asks a peer for (the service refuses more)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShardSummary(_Frozen):
    """One committed, checksummed shard a peer can serve."""

    step: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    data_nbytes: Annotated[int, Field(ge=0)]
    chunk_size: Annotated[int, Field(gt=0)]
    crc32c: int

    @classmethod
    def of(cls, m: Manifest) -> ShardSummary:
        assert m.crc32c is not None
        return cls(
            step=m.step,
            rank=m.rank,
            world_size=m.world_size,
            data_nbytes=m.data_nbytes,
            chunk_size=m.chunk_size,
            crc32c=m.crc32c,
        )


class PeerInventory(_Frozen):
    """``GET /v1/inventory``: what one peer holds for job ``job_id``."""

    wire_version: int = WIRE_VERSION
    job_id: str
    peer: str
    node: str | None = None
    domain: str | None = None
    ram: list[ShardSummary] = []
    """Its own RAM tier (the ranks it runs)."""
    replicas: dict[str, list[ShardSummary]] = {}
    """Owner peer id -> the owner's shards it holds a full copy of."""
    parity_steps: list[int] = []


class Segment(_Frozen):
    """Rank ``rank``'s data object at byte ``offset`` of its member's unit."""

    rank: Annotated[int, Field(ge=0)]
    offset: Annotated[int, Field(ge=0)]
    nbytes: Annotated[int, Field(ge=0)]


class ParityColumn(_Frozen):
    """Parity block ``k + index`` of column ``column`` of the group ``members`` (RS(k, m))."""

    column: Annotated[int, Field(ge=0)]
    members: list[str]
    m: Annotated[int, Field(ge=1)]
    index: Annotated[int, Field(ge=0)]
    offset: Annotated[int, Field(ge=0)]
    """Where the parity chunk lies in the holder's parity file (bytes)."""
    crc32c: int


class ParityRecord(_Frozen):
    """One holder's parity of one step (see the module docstring)."""

    wire_version: int = WIRE_VERSION
    job_id: str
    holder: str
    step: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    chunk_size: Annotated[int, Field(gt=0)]
    units: dict[str, list[Segment]]
    """Member peer id -> its unit layout."""
    manifests: dict[int, str]
    """Rank -> the raw manifest of its shard (as its owner committed it)."""
    columns: list[ParityColumn]
    data_nbytes: Annotated[int, Field(ge=0)]

    def owner_of(self, rank: int) -> tuple[str, Segment]:
        for peer, segs in self.units.items():
            for seg in segs:
                if seg.rank == rank:
                    return peer, seg
        raise KeyError(f"rank {rank} is in no unit of this parity record")


def unit_layout(manifests: Sequence[Manifest], chunk_size: int) -> list[Segment]:
    """The unit of a member holding ``manifests`` (one per rank): rank order, chunk-aligned.

    Raises ``ValueError`` when a manifest has another chunk size (chunks must line up).
    """
    out: list[Segment] = []
    offset = 0
    for m in sorted(manifests, key=lambda m: m.rank):
        if m.chunk_size != chunk_size:
            raise ValueError(
                f"rank {m.rank} step {m.step} uses chunk size {m.chunk_size}, the job "
                f"{chunk_size}: erasure coding needs one chunk size for every rank"
            )
        out.append(Segment(rank=m.rank, offset=offset, nbytes=m.data_nbytes))
        offset += -(-m.data_nbytes // chunk_size) * chunk_size
    return out


def unit_columns(segments: Sequence[Segment], chunk_size: int) -> int:
    """Number of chunk columns a unit spans."""
    end = max((s.offset + s.nbytes for s in segments), default=0)
    return -(-end // chunk_size)


def locate(
    segments: Sequence[Segment], column: int, chunk_size: int
) -> tuple[int, int, int] | None:
    """``(rank, offset in its data object, length)`` of unit chunk ``column``; None for padding."""
    start = column * chunk_size
    for s in segments:
        if s.offset <= start < s.offset + s.nbytes:
            off = start - s.offset
            return s.rank, off, min(chunk_size, s.nbytes - off)
    return None


def manifests_by_rank(raw: Mapping[int, str]) -> dict[int, bytes]:
    return {int(r): text.encode() for r, text in raw.items()}
