"""Shard manifest: the commit record of one rank's shard of one step (docs/architecture.md
"Layout").

A shard is two objects: ``rank-RRRRR.data`` (raw storage bytes, back to back, each storage aligned
to :data:`ALIGN`) and ``rank-RRRRR.manifest`` (this model as JSON), written LAST. The manifest
exists and verifies <=> the shard is committed in that tier.

Tensors are recorded the way ``torch.save`` does: by *storage* (so tied weights and views keep
sharing) plus per-tensor view metadata (dtype, shape, stride, storage offset). The non-tensor
state tree is JSON with tagged nodes (see :mod:`strata.format.codec`); nothing is unpickled on load.

Checksums: CRC32C (Castagnoli, google-crc32c) of every ``chunk_size`` bytes of the data object
(``chunk_crc32c``), so a partial read can be verified, and of the whole object (``crc32c``, the
value GCS reports as ``crc32c``). Optionally also of every :data:`SUB_CHUNK_SIZE` piece of the
logical object (``sub_crc32c``, :class:`SubChunkCrcs`), so that a ranged read (a resharding
restore's slice) costs about its own bytes instead of whole chunks.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError
from pydantic_core import to_json

from strata.errors import FormatError, ManifestError
from strata.format.sealed import seal_parts, unseal

FORMAT_VERSION = 2
"""Version of every Strata record (shard manifest, commit record, incarnation record).

2: manifests carry ``incarnation``; steps get a global commit record (later
optional fields were added under the same number); manifests are sealed like
the commit record (:mod:`strata.format.sealed`)."""
ALIGN = 64
"""Byte alignment of each storage in the data object (cache line; keeps copies vectorised)."""
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
SUB_CHUNK_SIZE = 128 * 1024
"""Bytes per sub-chunk CRC32C (:class:`SubChunkCrcs`) recorded by the save path.

Why 128 KiB: a ranged read (a slice of a saved tensor, at a new world size) is rounded out to
the pieces that verify it, so it costs its bytes plus at most two pieces (one on average for a
slice at an arbitrary offset, none for one on a piece boundary: power-of-two rows). With 4 MiB
chunks alone a 0.5-1 MiB slice cost 4-8 MiB (``bench.sharded --mb 64``: growing 4 -> 8 ranks
read 1.64-1.82x the bytes it needed). Measured with ``bench.sharded --rounds 2``, bytes read
over bytes needed, 4 -> 8 ranks: 256 KiB pieces 1.00 with aligned slices (``--mb 64``) but
1.15-1.16 with 480 KiB slices at unaligned offsets (``--mb 60``); 128 KiB pieces 1.00 and
1.06-1.07. The price is in the manifest: 4 bytes per piece, base64 (5.3 characters), so a
64 GiB shard's manifest grows by 2.8 MB (524,288 pieces; its 4 MiB chunk list is ~0.18 MB of
JSON) and a step of 16,384 such ranks by 46 GB of manifests against 1 PiB of data (4e-5).
Ranks read only the manifests of the saved ranks whose bytes they need. 64 KiB pieces would
cost 5.6 MB per such manifest; 1 MiB pieces would leave 0.5 MiB slices at 2x.

The save path computes the pieces' CRCs in the pass that computed the chunks' (one C call per
piece instead of per chunk) and derives each chunk's CRC from its pieces by a fixed-length
CRC combine (:func:`strata.format.crc.join_pieces`): no second pass over the bytes."""


class SubChunkCrcs(BaseModel):
    """CRC32C of every ``size``-byte piece of the LOGICAL data object (the last piece may be
    shorter): the same for a full copy and an incremental one (:class:`ChunkRefs`), so promotion
    copies it unchanged. ``size`` divides ``Manifest.chunk_size``.

    ``crc32c``: the CRCs as big-endian unsigned 32-bit integers, base64 (the encoding GCS uses
    for an object's ``crc32c``), a compact form for a list that is 16x longer than
    ``chunk_crc32c``: ``values()`` decodes it (once per object).

    Trust: the pieces of a chunk must combine to that chunk's CRC32C (``chunk_crc32c`` or
    ``logical_chunk_crc32c``); a reader checks this before it trusts a piece's CRC
    (:func:`strata.tiers.references.read_logical`). A manifest without it (written before it
    existed, or by a path that does not compute it) is read by whole chunks, as before.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    size: Annotated[int, Field(gt=0)]
    crc32c: str
    _values: tuple[int, ...] | None = PrivateAttr(None)

    @classmethod
    def of(cls, crcs: list[int] | tuple[int, ...], size: int) -> SubChunkCrcs:
        """The record of the piece CRCs ``crcs`` (ints < 2**32) of ``size`` bytes each."""
        raw = struct.pack(f">{len(crcs)}I", *crcs)
        out = cls(size=size, crc32c=base64.b64encode(raw).decode("ascii"))
        out._values = tuple(crcs)
        return out

    def values(self) -> tuple[int, ...]:
        """The piece CRCs, in order. Raises ``ValueError`` when ``crc32c`` is not base64 of a
        whole number of 4-byte values."""
        if self._values is None:
            raw = base64.b64decode(self.crc32c, validate=True)
            if len(raw) % 4:
                raise ValueError(f"sub-chunk CRCs of {len(raw)} bytes (not a multiple of 4)")
            self._values = struct.unpack(f">{len(raw) // 4}I", raw)
        return self._values

    def __eq__(self, other: object) -> bool:
        """Equal fields (the decoded cache is no part of the value)."""
        if not isinstance(other, SubChunkCrcs):
            return NotImplemented
        return self.size == other.size and self.crc32c == other.crc32c

    def __hash__(self) -> int:
        return hash((self.size, self.crc32c))


class StorageEntry(BaseModel):
    """One untyped storage: ``nbytes`` bytes at ``offset`` in the data object."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    offset: Annotated[int, Field(ge=0)]
    nbytes: Annotated[int, Field(ge=0)]


class TensorEntry(BaseModel):
    """A tensor as a view of a storage (element units are of ``dtype``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    storage: Annotated[int, Field(ge=0)]
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``bfloat16``."""
    shape: list[Annotated[int, Field(ge=0)]]
    stride: list[int]
    storage_offset: Annotated[int, Field(ge=0)] = 0
    requires_grad: bool = False


class LayoutJson:
    """The JSON of a manifest's ``tensors`` and ``storages`` lists, serialised once and spliced
    into every manifest of the same layout (:meth:`Manifest.to_json`): they depend only on the
    layout, and are most of the manifest of a state of many small tensors (bench W3: 9 of the
    11 ms of serialising a 10,000-tensor manifest). Also the tree's JSON, by node
    (:meth:`tree_json`). Thread-safe; the lists and the tree nodes must not change."""

    def __init__(self, tensors: list[TensorEntry], storages: list[StorageEntry]) -> None:
        self.tensors = tensors
        self.storages = storages
        self._json: bytes | None = None
        self._lock = threading.Lock()
        self._tree: dict[int, tuple[Any, bytes]] = {}
        self.serialised = 0
        """How many times the lists were serialised (tests: once per layout)."""

    def tree_json(self, tree: Any) -> bytes:
        """``tree`` as JSON, the bytes ``model_dump_json`` writes for it; a dict or list node
        that is the very object met in the previous call (the encoder reuses unchanged nodes:
        :meth:`strata.format.encode_cache.Replayer.shared`) is not serialised again."""
        with self._lock:
            hit = self._tree.get(id(tree))
            if hit is not None and hit[0] is tree:  # the same tree again (the checksum pass)
                return hit[1]  # keeping the memo of its nodes for the next save's tree
            new: dict[int, tuple[Any, bytes]] = {}
            out = _tree_json(tree, self._tree, new)
            self._tree = new
            return out

    def json(self) -> bytes:
        """``,"tensors":[...],"storages":[...],`` exactly as ``model_dump_json`` writes them."""
        with self._lock:
            if self._json is None:
                self._json = (
                    b',"tensors":'
                    + _TENSORS.dump_json(self.tensors)
                    + b',"storages":'
                    + _STORAGES.dump_json(self.storages)
                    + b","
                )
                self.serialised += 1
            return self._json


class ChunkRefs(BaseModel):
    """An incremental shard: chunks of the *logical* data object that this tier does
    not store again because they are byte-identical to the same chunks of ``base_step`` (a full
    shard of the same rank, incarnation and layout, committed in the same tier).

    The stored data object holds only the other chunks, in order (its ``data_nbytes``,
    ``chunk_crc32c`` and ``crc32c`` describe what is stored); the logical object (what a restore
    loads, what the codec's offsets address) is ``logical_nbytes`` bytes with per-chunk CRC32Cs
    ``logical_chunk_crc32c`` and whole CRC32C ``logical_crc32c``. See
    :mod:`strata.format.incremental`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    base_step: Annotated[int, Field(ge=0)]
    chunks: list[Annotated[int, Field(ge=0)]]
    """Logical chunk indices read from ``base_step``'s data object (ascending)."""
    logical_nbytes: Annotated[int, Field(ge=0)]
    logical_chunk_crc32c: list[int]
    logical_crc32c: int


class ShardedEntry(BaseModel):
    """One rank's view of one sharded tensor (element units; :mod:`strata.format.placement`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    """The tensor's path in the state tree (``state['model']['w']``): its global key."""
    dtype: str
    global_shape: list[Annotated[int, Field(ge=0)]]
    offsets: list[Annotated[int, Field(ge=0)]]
    lengths: list[Annotated[int, Field(ge=0)]]
    owner: Annotated[int, Field(ge=0)]
    """The rank whose shard holds this chunk's bytes."""
    tensor: Annotated[int, Field(ge=0)] | None = None
    """Index into ``Manifest.tensors`` when this rank is the owner, else None (a reference)."""
    mesh: list[int] = Field(default_factory=list)
    """Global ranks of the device mesh, flattened row-major ([] for a plain replicated tensor:
    every rank of the world)."""
    mesh_shape: list[int] = Field(default_factory=list)
    placements: str = ""
    """``repr`` of the placements (``(Shard(dim=0), Replicate())``; "" for a plain tensor)."""
    param: bool = False
    requires_grad: bool = False

    @property
    def region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self.offsets), tuple(self.lengths)


class Manifest(BaseModel):
    """The commit record of rank ``rank``'s shard of step ``step`` of job ``job_id``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["strata-shard"] = "strata-shard"
    format_version: int = FORMAT_VERSION
    job_id: str
    step: Annotated[int, Field(ge=0)]
    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    writer_id: str
    incarnation: str = ""
    """Id of the incarnation of the job that wrote this shard (:mod:`strata.format.incarnation`);
    ``""`` only for shards written outside any incarnation (tools, tests). Shards of different
    incarnations are never one step."""
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    tree: Any
    """The state tree with tensors replaced by ``{"__tensor__": index}`` (see strata.format.codec)."""
    tensors: list[TensorEntry]
    storages: list[StorageEntry]
    data_nbytes: Annotated[int, Field(ge=0)]
    """Meaningful length of the data object (a RAM slot file may be longer)."""
    chunk_size: Annotated[int, Field(gt=0)] = DEFAULT_CHUNK_SIZE
    chunk_crc32c: list[int] | None = None
    crc32c: int | None = None
    """None only transiently in the RAM tier, before the background checksum pass."""
    unchanged_since: list[int] | None = None
    """Per storage: the step since which the trainer saw the storage unchanged (same address
    and size, no tensor version-counter bump). A HINT only, confirmed by CRC32C before any
    bytes are referenced instead of copied; None: no hint."""
    refs: ChunkRefs | None = None
    component_steps: dict[str, int] | None = None
    """Components saved at their own cadence: the step each one's bytes come from
    (:mod:`strata.client.cadence`). None: every component is from ``step``."""
    components: list[str] | None = None
    """Archive-only shard: it holds only these top-level components of the state
    (:mod:`strata.format.projection`); it is never used to resume training. None: everything."""
    """Set only on an incremental copy in a durable tier (never in RAM); see :class:`ChunkRefs`."""
    sharded: list[ShardedEntry] = Field(default_factory=list)
    """Sharded tensors (DTensors, declared-replicated tensors): tree nodes ``{"__sharded__": i}``
    (:mod:`strata.format.placement`); empty for a state without them."""
    sub_crc32c: SubChunkCrcs | None = None
    """CRC32C per :data:`SUB_CHUNK_SIZE` piece of the logical data object (ranged reads);
    None: not recorded (ranged reads verify whole chunks). Added under format version 2."""

    _layout: tuple[LayoutJson, list[TensorEntry], list[StorageEntry]] | None = PrivateAttr(None)

    def __eq__(self, other: object) -> bool:
        """Equal fields: the cached layout JSON (:meth:`with_layout_json`) is no part of a
        manifest's value (pydantic's own ``==`` would compare it too)."""
        if not isinstance(other, Manifest):
            return NotImplemented
        return (
            type(self) is type(other)
            and self.__dict__ == other.__dict__
            and self.__pydantic_extra__ == other.__pydantic_extra__
        )

    def with_layout_json(self, layout: LayoutJson) -> Manifest:
        """This manifest (itself), stating that its ``tensors``/``storages`` are those of
        ``layout`` (element for element), so :meth:`to_json` splices ``layout``'s cached JSON
        instead of serialising them. A copy with other ``tensors`` or ``storages`` lists
        (``model_copy(update=...)``) serialises them itself."""
        self._layout = (layout, self.tensors, self.storages)
        return self

    def check_identity(self, job_id: str, step: int, rank: int, world_size: int | None) -> None:
        """Raise :class:`ManifestError` when this manifest is not the shard that was asked for."""
        if self.format_version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format version {self.format_version} is not supported "
                f"(this Strata reads {FORMAT_VERSION}); upgrade Strata or restore an older step"
            )
        wrong = []
        if self.job_id != job_id:
            wrong.append(f"job id {self.job_id!r} != {job_id!r}")
        if self.step != step:
            wrong.append(f"step {self.step} != {step}")
        if self.rank != rank:
            wrong.append(f"rank {self.rank} != {rank}")
        if world_size is not None and self.world_size != world_size:
            wrong.append(f"world size {self.world_size} != {world_size}")
        if wrong:
            raise ManifestError("manifest belongs to another shard: " + ", ".join(wrong))

    @property
    def verified(self) -> bool:
        """Checksums are recorded (a shard is only promoted or trusted once they are)."""
        return self.crc32c is not None and self.chunk_crc32c is not None

    def to_json(self) -> bytes:
        """The stored form: the JSON sealed with its CRC32C (:func:`strata.format.sealed.seal`),
        so every tier verifies it on the raw bytes before any field is read.

        A manifest of an encoded layout (:meth:`with_layout_json`: the trainer's saves) is
        remembered with its bytes, so that reading those very bytes back in this process
        (:meth:`from_json`: the checksum pass, a restore) returns it without parsing them again
        (bench W3: 0.2 s of validation per read of a 10,000-tensor manifest)."""
        raw = seal_parts(self._body_parts())
        if self._layout is not None:
            _parsed_put(raw, self)
        return raw

    def _body_parts(self) -> tuple[bytes, ...]:
        """The JSON body, ``model_dump_json()``'s bytes, in parts (joined once, by the seal)."""
        # The serializer's bytes are model_dump_json()'s, without a decode and an encode.
        dump = self.__pydantic_serializer__.to_json
        cached = self._layout
        if cached is None or cached[1] is not self.tensors or cached[2] is not self.storages:
            return (dump(self),)
        head = dump(self.model_copy(update={"tree": None, "tensors": [], "storages": []}))
        # The last occurrence is the manifest's own fields: no field after them can hold this
        # text (JSON strings escape '"'), and the fields before are scalars.
        at = head.rfind(_EMPTY_LAYOUT)
        if at < 0:  # pragma: no cover - pydantic changed its field order or spacing
            return (dump(self),)
        layout = cached[0]
        return (
            head[:at],
            b',"tree":',
            layout.tree_json(self.tree),
            layout.json(),
            head[at + len(_EMPTY_LAYOUT) :],
        )

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        """Parse stored manifest bytes; the seal is verified before any field is read.

        Raises :class:`ManifestVersionError` for an unsealed manifest whose body says it is of
        an older format version, or a sealed (intact) one with fields this Strata does not know
        or another format version (written by another Strata version: skip it, never
        quarantine), :class:`ManifestError` for anything else that does not verify or parse (a
        damaged copy: quarantine it).

        The same bytes parse to the same (frozen, shared) object: the last :data:`PARSED_KEEP`
        manifests parsed are kept by their exact bytes, because one restore reads one manifest
        up to ten times (inventory, staging, leases), and parsing one of 10,000 tensors took
        ~0.1 s. Callers never change a parsed manifest in place (``model_copy(update=...)``).
        """
        cached = _parsed_get(raw) if cls is Manifest else None
        if cached is not None:
            return cached
        try:
            body = unseal(raw, where)
        except FormatError as exc:
            version = _json_version(raw)
            if version is not None and version < FORMAT_VERSION:
                raise ManifestVersionError(
                    f"{where}: manifest format version {version}, this Strata reads "
                    f"{FORMAT_VERSION}; restore another step (or use the Strata that wrote it)",
                    version,
                ) from None
            raise ManifestError(f"malformed manifest {where}: {exc}") from None
        try:
            m = cls.model_validate_json(body)
            if cls is Manifest:
                _parsed_put(raw, m)
            return m
        except ValidationError as exc:
            # The seal verified, so these are the bytes a writer meant. Fields this Strata does
            # not know, or another format version, come from another version of Strata (a rolling
            # upgrade: trainer and sidecar images of two versions), not from damage: skip the
            # copy; quarantining it would destroy a valid checkpoint. Anything else is malformed.
            version = _json_version(body)
            newer = all(e["type"] == "extra_forbidden" for e in exc.errors())
            if newer or (version is not None and version != FORMAT_VERSION):
                raise ManifestVersionError(
                    f"{where}: manifest written by another Strata version (format version "
                    f"{version}; {_first_line(exc)}); restore another step or use a Strata "
                    "that reads it",
                    version if version is not None else -1,
                ) from None
            raise ManifestError(f"malformed manifest {where}: {exc}") from None
        except ValueError as exc:
            raise ManifestError(f"malformed manifest {where}: {exc}") from None


PARSED_KEEP = 8
"""Parsed manifests kept by :meth:`Manifest.from_json`, keyed by their exact stored bytes."""
_parsed: dict[bytes, Manifest] = {}
_parsed_lock = threading.Lock()


def _parsed_get(raw: bytes) -> Manifest | None:
    if not isinstance(raw, bytes):
        return None
    with _parsed_lock:
        m = _parsed.pop(raw, None)
        if m is not None:
            _parsed[raw] = m  # most recently used last
        return m


def _parsed_put(raw: bytes, m: Manifest) -> None:
    if not isinstance(raw, bytes):
        return
    with _parsed_lock:
        _parsed[raw] = m
        while len(_parsed) > PARSED_KEEP:
            del _parsed[next(iter(_parsed))]


_TENSORS = TypeAdapter(list[TensorEntry])
_STORAGES = TypeAdapter(list[StorageEntry])
_EMPTY_LAYOUT = b',"tree":null,"tensors":[],"storages":[],'
_DESCEND = 64
"""A new tree node of more entries is serialised in one call (C), not entry by entry."""


def _tree_json(
    node: Any, memo: dict[int, tuple[Any, bytes]], new: dict[int, tuple[Any, bytes]]
) -> bytes:
    kind = type(node)
    if kind is not dict and kind is not list:
        return to_json(node)
    hit = memo.get(id(node))
    if hit is not None and hit[0] is node:
        new[id(node)] = hit
        return hit[1]
    if len(node) > _DESCEND:
        out = to_json(node)
    elif kind is dict:
        out = b"{%s}" % b",".join(
            b"%s:%s" % (to_json(k), _tree_json(v, memo, new)) for k, v in node.items()
        )
    else:
        out = b"[%s]" % b",".join(_tree_json(v, memo, new) for v in node)
    new[id(node)] = (node, out)
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _json_version(raw: bytes | str) -> int | None:
    """``format_version`` of a JSON manifest body (an unsealed one written before version 2, or
    a sealed one this Strata cannot validate), else None."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    version = obj.get("format_version") if isinstance(obj, dict) else None
    return version if type(version) is int else None


class ManifestVersionError(ManifestError):
    """An intact manifest of another format version (``format_version``): skip, never
    quarantine."""

    def __init__(self, message: str, format_version: int) -> None:
        super().__init__(message)
        self.format_version = format_version
