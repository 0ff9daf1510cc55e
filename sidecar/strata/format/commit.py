"""Global commit record of one step in one tier: ``<job>/steps/<step>/commit.json``.

A step is **complete in a tier** exactly when a commit record verifies there: it is written LAST,
after every rank's shard of the step is committed in that tier, and only when all those shards
belong to ONE incarnation of the job and one world size. It names each shard with its size and
checksums, so a reader can tell a shard that was replaced after the commit (another incarnation's
replay) from the one that was committed. It is sealed (:mod:`strata.format.sealed`): its CRC32C
is checked on the raw bytes before any field is parsed.

The RAM tier has no commit record (it is per node): RAM completeness across nodes is decided by
the restore all-gather, which also compares incarnations.

Extension points (each adds an OPTIONAL field with a default, so records without it still parse
and code that ignores it keeps working; ``format_version`` stays :data:`FORMAT_VERSION`):
``tensors`` (global tensor layout and each shard's placement), where peer replicas live, and
``archive_only`` and the component sources of chunks from earlier steps.

Who writes it and what happens when the writer dies: docs/architecture.md "Global commit".
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, ClassVar, Literal

import google_crc32c
from pydantic import BaseModel, ConfigDict, Field, model_validator

from strata.errors import CommitError, ManifestError
from strata.format.manifest import FORMAT_VERSION, Manifest
from strata.format.sealed import SealedRecord


class ShardRef(BaseModel):
    """One rank's committed shard as the commit record names it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rank: Annotated[int, Field(ge=0)]
    data_nbytes: Annotated[int, Field(ge=0)]
    """Meaningful length of the data object, bytes (``Manifest.data_nbytes``)."""
    crc32c: int
    """CRC32C of the data object (``Manifest.crc32c``)."""
    manifest_crc32c: int
    """CRC32C of the manifest object's bytes as stored in this tier."""

    @classmethod
    def of(cls, manifest: Manifest, manifest_raw: bytes) -> ShardRef:
        """The reference to a committed shard from its manifest and the manifest's stored bytes.

        Raises :class:`CommitError` when the shard has no checksums yet (a RAM shard before its
        checksum pass is never part of a commit)."""
        if manifest.crc32c is None:
            raise CommitError(
                f"rank {manifest.rank} of step {manifest.step} has no data checksum yet; "
                "a shard is committed in a tier only once checksummed"
            )
        return cls(
            rank=manifest.rank,
            data_nbytes=manifest.data_nbytes,
            crc32c=manifest.crc32c,
            manifest_crc32c=manifest_crc(manifest_raw),
        )


class TensorChunk(BaseModel):
    """Where one chunk of a sharded tensor's bytes lie: ``rank``'s shard, the slice it covers
    (element offsets and lengths per dimension)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rank: Annotated[int, Field(ge=0)]
    offsets: list[Annotated[int, Field(ge=0)]]
    lengths: list[Annotated[int, Field(ge=0)]]


class TensorLayout(BaseModel):
    """The global layout of one sharded tensor of the step (``path`` is its place in
    the state tree, the key shards use in ``Manifest.sharded``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    dtype: str
    global_shape: list[Annotated[int, Field(ge=0)]]
    placements: str = ""
    mesh_shape: list[int] = Field(default_factory=list)
    chunks: list[TensorChunk]
    """Every stored chunk (each replicated chunk once: its owner's), by rank then path order."""


def tensor_layouts(manifests: list[Manifest]) -> list[TensorLayout]:
    """The ``tensors`` of a commit record from the step's shard manifests (ranks in order)."""
    out: dict[str, TensorLayout] = {}
    for m in manifests:
        for e in m.sharded:
            lay = out.get(e.path)
            if lay is None:
                lay = out[e.path] = TensorLayout(
                    path=e.path,
                    dtype=e.dtype,
                    global_shape=e.global_shape,
                    placements=e.placements,
                    mesh_shape=e.mesh_shape,
                    chunks=[],
                )
            if e.tensor is not None:
                lay.chunks.append(TensorChunk(rank=m.rank, offsets=e.offsets, lengths=e.lengths))
    return list(out.values())


def manifest_crc(manifest_raw: bytes) -> int:
    """CRC32C of a manifest object's stored bytes (what ``ShardRef.manifest_crc32c`` records)."""
    return int(google_crc32c.value(manifest_raw))


class StepCommit(SealedRecord):
    """Step ``step`` of job ``job_id`` is committed in this tier by incarnation ``incarnation``
    at world size ``world_size``, with exactly the shards in ``shards`` (ranks 0..world_size-1,
    in rank order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    record_kind: ClassVar[str] = "commit record"
    format: Literal["strata-step-commit"] = "strata-step-commit"
    format_version: int = FORMAT_VERSION
    job_id: str
    step: Annotated[int, Field(ge=0)]
    incarnation: str
    world_size: Annotated[int, Field(ge=1)]
    writer_id: str
    """Who wrote the record (``<pod or host>/<pid>`` of the sidecar); for people, not logic."""
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    shards: list[ShardRef]
    archive_only: bool = False
    """The shards keep only some components (an archive tier): never resumed."""
    component_steps: dict[str, int] | None = None
    """Components saved at their own cadence: the step each comes from."""
    tensors: list[TensorLayout] = Field(default_factory=list)
    """the global layout of every sharded tensor (DTensors, declared-replicated
    tensors) and which rank stores each chunk; empty for a state without them."""

    @model_validator(mode="after")
    def _every_rank_once(self) -> StepCommit:
        ranks = [s.rank for s in self.shards]
        if ranks != list(range(self.world_size)):
            raise ValueError(
                f"shards must be ranks 0..{self.world_size - 1} in order, got {ranks[:8]}"
                + ("..." if len(ranks) > 8 else "")
            )
        return self

    def shard(self, rank: int) -> ShardRef:
        """The committed shard of ``rank``; :class:`CommitError` outside the world size."""
        if not 0 <= rank < self.world_size:
            raise CommitError(
                f"step {self.step} was committed at world size {self.world_size}; "
                f"it has no rank {rank}"
            )
        return self.shards[rank]

    def check_identity(self, job_id: str, step: int) -> None:
        """Raise :class:`CommitError` when this record is not the one of ``job_id``/``step``."""
        if self.format_version != FORMAT_VERSION:
            raise CommitError(
                f"commit record format version {self.format_version} is not supported "
                f"(this Strata reads {FORMAT_VERSION}); upgrade Strata or restore another step"
            )
        wrong = []
        if self.job_id != job_id:
            wrong.append(f"job id {self.job_id!r} != {job_id!r}")
        if self.step != step:
            wrong.append(f"step {self.step} != {step}")
        if wrong:
            raise CommitError("commit record belongs to another step: " + ", ".join(wrong))

    def matches(self, manifest: Manifest, manifest_raw: bytes) -> bool:
        """``manifest`` (with its stored bytes) is the shard this record committed for its rank."""
        if manifest.incarnation != self.incarnation or manifest.world_size != self.world_size:
            return False
        if not 0 <= manifest.rank < self.world_size:
            return False
        ref = self.shards[manifest.rank]
        return (
            ref.manifest_crc32c == manifest_crc(manifest_raw)
            and ref.crc32c == manifest.crc32c
            and ref.data_nbytes == manifest.data_nbytes
        )

    def same_commit(self, other: StepCommit) -> bool:
        """Both records commit the same shards (what an idempotent second writer checks)."""
        return (
            self.job_id == other.job_id
            and self.step == other.step
            and self.incarnation == other.incarnation
            and self.world_size == other.world_size
            and self.shards == other.shards
        )


def build_commit(
    job_id: str,
    step: int,
    shards: Mapping[int, tuple[Manifest, bytes]],
    writer_id: str,
    incarnation: str | None = None,
) -> StepCommit:
    """The commit record for ``shards`` (rank -> (manifest, manifest's stored bytes)).

    ``incarnation``: when given, every shard must belong to it. Raises :class:`CommitError`
    saying why the step is not committable: a rank missing, shards of several incarnations or
    world sizes, another job or step, a shard without checksums.
    """
    if not shards:
        raise CommitError(f"step {step} has no shards")
    manifests = [m for m, _ in shards.values()]
    incs = sorted({m.incarnation for m in manifests})
    if len(incs) != 1:
        raise CommitError(
            f"step {step} mixes shards of incarnations {incs}; never one step "
            "(the newer incarnation's shards replace the others)"
        )
    if incarnation is not None and incs[0] != incarnation:
        raise CommitError(
            f"step {step} belongs to incarnation {incs[0]!r}, not the current {incarnation!r}"
        )
    sizes = sorted({m.world_size for m in manifests})
    if len(sizes) != 1:
        raise CommitError(f"step {step} mixes shards of world sizes {sizes}")
    world = sizes[0]
    for rank, (m, _) in shards.items():
        try:
            m.check_identity(job_id, step, rank, world)
        except ManifestError as exc:
            raise CommitError(f"step {step} rank {rank}: {exc}") from None
    missing = sorted(set(range(world)) - set(shards))
    if missing:
        raise CommitError(
            f"step {step} (world size {world}) lacks ranks {missing[:8]}"
            + ("..." if len(missing) > 8 else "")
        )
    extra = sorted(set(shards) - set(range(world)))
    if extra:
        raise CommitError(f"step {step} has ranks {extra[:8]} beyond world size {world}")
    kept = {tuple(m.components) if m.components is not None else None for m in manifests}
    if len(kept) != 1:
        raise CommitError(
            f"step {step} mixes archive-only and full shards ({sorted(map(str, kept))})"
        )
    refs = [ShardRef.of(*shards[r]) for r in range(world)]
    return StepCommit(
        job_id=job_id,
        step=step,
        incarnation=incs[0],
        world_size=world,
        writer_id=writer_id,
        shards=refs,
        archive_only=kept != {None},
        component_steps=shards[0][0].component_steps,
        tensors=tensor_layouts([shards[r][0] for r in range(world)]),
    )
