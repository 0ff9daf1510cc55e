"""Verified pulls from a peer: a shard's manifest, one chunk, a whole shard into a local file.

Every chunk is checked against the manifest's ``chunk_crc32c`` as it arrives, and a whole shard
against the combined ``crc32c``: a peer that serves a corrupt copy (bit flip, a bug, a stale
slot) raises :class:`CorruptCopy`, and the caller skips that peer for that shard.

URL scheme (``base``): ``/v1/ram/<step>/<rank>`` (the peer's own RAM tier) or
``/v1/replica/<owner>/<step>/<rank>`` (a copy it holds), each with ``/manifest`` and
``/data?offset=&length=``.
"""

from __future__ import annotations

import os
from pathlib import Path

from strata.errors import ShardCorrupt, ShardUnavailable
from strata.format import crc
from strata.format.manifest import Manifest
from strata.peers.transport import PeerClient, PeerError
from strata.tiers.base import parse_manifest


class CorruptCopy(ShardCorrupt):
    """A peer served bytes or a manifest that do not verify; skip that peer's copy."""


def fetch_manifest(
    client: PeerClient, base: str, job_id: str, step: int, rank: int
) -> tuple[bytes, Manifest]:
    """Raw bytes and parsed manifest; :class:`ShardUnavailable` when missing or not checksummed,
    :class:`CorruptCopy` when malformed or naming another shard."""
    where = f"peer {client.endpoint.id}:{base}/manifest"
    try:
        raw = client.get(f"{base}/manifest")
    except PeerError as exc:
        raise ShardUnavailable(str(exc)) from None
    try:
        m = parse_manifest(raw, where, job_id, step, rank)
    except ShardCorrupt as exc:
        raise CorruptCopy(str(exc)) from None
    if not m.verified:
        raise ShardUnavailable(f"{where}: not checksummed yet")
    return raw, m


def fetch_chunk(client: PeerClient, base: str, m: Manifest, index: int) -> bytes:
    """Chunk ``index`` of the shard, verified against ``m.chunk_crc32c[index]``."""
    off = index * m.chunk_size
    n = min(m.chunk_size, m.data_nbytes - off)
    if n <= 0:
        raise ValueError(f"chunk {index} is beyond the {m.data_nbytes}-byte shard")
    try:
        data = client.get(f"{base}/data", {"offset": off, "length": n})
    except PeerError as exc:
        raise ShardUnavailable(str(exc)) from None
    expected = (m.chunk_crc32c or [])[index] if index < len(m.chunk_crc32c or []) else None
    if len(data) != n or crc.crc32c(data) != expected:
        raise CorruptCopy(
            f"peer {client.endpoint.id}:{base}: chunk {index} (from byte {off}) does not match "
            f"its manifest's CRC32C; that peer's copy is corrupt and is skipped"
        )
    return data


def copy_shard(client: PeerClient, base: str, m: Manifest, dst: Path) -> None:
    """Pull the whole shard into ``dst`` (created, not truncated), verifying every chunk and the
    whole-object CRC32C. Raises :class:`CorruptCopy` or :class:`ShardUnavailable`."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        crcs = []
        for i in range(crc.n_chunks(m.data_nbytes, m.chunk_size)):
            data = fetch_chunk(client, base, m, i)
            os.pwrite(fd, data, i * m.chunk_size)
            crcs.append(crc.crc32c(data))
        whole = crc.combine_chunks(crcs, m.data_nbytes, m.chunk_size) if crcs else 0
        if whole != (m.crc32c or 0):
            raise CorruptCopy(f"peer {client.endpoint.id}:{base}: whole-object CRC32C mismatch")
    finally:
        os.close(fd)
