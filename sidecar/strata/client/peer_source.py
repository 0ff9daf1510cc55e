"""The peer tier as the trainer reaches it: through its sidecar's local API.

The peers (other nodes' RAM tiers, the replicas and parity they keep, docs/peers.md) are read
over mutual TLS, and only the sidecar holds the job's TLS material, so the trainer cannot reach
them itself. :class:`PeerSource` is a read-only :class:`strata.tiers.base.Tier` named ``peer``
whose every call is one local-API request served by the sidecar's
:class:`strata.peers.tier.PeerTier` (``/v1/peer/*``, :mod:`strata.protocol`): a resharding
restore (:func:`strata.restore.reshard.reshard_sources`, :class:`strata.client.sharded.ShardReader`,
:func:`strata.tiers.references.read_logical`) reads a step written at another world size from
the peers by ranges, as from any tier.

Trust: the sidecar forwards the peers' bytes unverified; the trainer checks the manifest's seal
and identity (:func:`strata.tiers.base.parse_manifest`) and every byte read against the
manifest's chunk CRC32Cs, as for every tier.

Errors: a shard no peer serves, or a sidecar that stopped answering, is
:class:`strata.errors.ShardUnavailable` (the reader falls back to the next source); a sidecar
without a peer tier gives no source at all (:func:`peer_source` returns None, not an error).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

from strata.client.sidecar_client import SidecarClient
from strata.config import StrataConfig
from strata.errors import ShardUnavailable, SidecarUnavailable, TierError
from strata.format import crc
from strata.format.manifest import Manifest
from strata.tiers.base import StepListing, Tier, parse_manifest

log = logging.getLogger("strata.client")


class PeerSource(Tier):
    """The job's peer tier through the sidecar on ``client`` (see the module docstring).

    ``max_range``: the most bytes one ``/v1/peer/range`` request asks for (the sidecar's
    :attr:`strata.protocol.PeerInfoReply.max_range`). ``nbytes_fetched``: data bytes received
    over the local API so far (ranges and whole-shard fetches; manifests not counted).
    """

    # A restore source (config.SourceName), not a configurable tier: only restore sees it.
    name = "peer"  # type: ignore[assignment]

    def __init__(self, client: SidecarClient, job_id: str, max_range: int) -> None:
        if max_range < 1:
            raise ValueError(f"max_range must be at least 1 byte, got {max_range}")
        self.client = client
        self.job_id = job_id
        self.max_range = max_range
        self.nbytes_fetched = 0
        self.reader = f"{os.getpid()}-{uuid.uuid4().hex}"
        """This source's id in its range requests and drops: the sidecar keeps the shards it
        rebuilt for ranged reads until every source reading them dropped them."""
        self.notes: list[str] = []
        """The sidecar's notes from the last listing (peers unreachable, beyond tolerance),
        each starting ``peer``; a restore adds them to its notes (``RestoreResult.skipped``)."""

    def __repr__(self) -> str:
        return f"PeerSource({self.client.socket_path!r})"

    # -- listing ----------------------------------------------------------------------------------

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        """What the peers hold, by step (one request; the sidecar asks every peer). Raises
        :class:`TierError` (ShardUnavailable when the sidecar has no peer tier any more)."""
        reply = self.client.peer_steps(job_id)
        self.notes = [n if n.startswith("peer") else f"peer: {n}" for n in reply.notes]
        return {
            s.step: StepListing(s.step, frozenset(s.committed_ranks), world_size=s.world_size)
            for s in reply.steps
        }

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        raw = self._unless_gone(partial(self.client.peer_manifest, job_id, step, rank), step, rank)
        where = f"the peers' copy of step {step} rank {rank} (via {self.client.socket_path})"
        return parse_manifest(raw, where, job_id, step, rank)

    # -- reading ----------------------------------------------------------------------------------

    def read_range(self, job_id: str, step: int, rank: int, offset: int, nbytes: int) -> bytes:
        """Bytes ``[offset, offset + nbytes)`` of the stored data object, NOT verified (the
        caller checks them: :func:`strata.tiers.references.read_logical`), in requests of at
        most :attr:`max_range` bytes; fewer bytes only where the object ends. Raises
        :class:`ShardUnavailable` when no peer serves it or the sidecar does not answer."""
        if nbytes <= 0:
            return b""
        parts: list[bytes] = []
        done = 0
        while done < nbytes:
            want = min(self.max_range, nbytes - done)
            read = partial(
                self.client.peer_range, job_id, step, rank, offset + done, want, self.reader
            )
            piece = self._unless_gone(read, step, rank)
            parts.append(piece)
            done += len(piece)
            self.nbytes_fetched += len(piece)
            if len(piece) < want:
                break  # the object ends first
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        """Copy the shard into ``dst_path`` by ranges, always verified against its manifest
        (``verify`` is ignored: a peer's bytes are never trusted unchecked). Raises
        :class:`ShardUnavailable` (not served, or shorter than its manifest) or
        :class:`strata.errors.ShardCorrupt`."""
        m = self.get_manifest(job_id, step, rank)
        fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            done = 0
            while done < m.data_nbytes:
                piece = self.read_range(
                    job_id, step, rank, done, min(self.max_range, m.data_nbytes - done)
                )
                if not piece:
                    raise ShardUnavailable(
                        f"the peers' copy of step {step} rank {rank} ends at byte {done}, its "
                        f"manifest records {m.data_nbytes}; restore from another tier"
                    )
                os.pwrite(fd, piece, done)
                done += len(piece)
        finally:
            os.close(fd)
        crcs, whole = crc.file_chunk_crcs(dst_path, m.data_nbytes, m.chunk_size)
        crc.check_shard_crcs(f"the peers' copy of step {step} rank {rank}", m, crcs, whole)
        return m

    def drop_fetched(self) -> None:
        """This source is done with the shards the sidecar rebuilt whole (from parity) for its
        ranged reads: the sidecar removes them once no other source of the node (another rank)
        still reads them (best effort)."""
        self.client.peer_drop(self.job_id, self.reader)

    def _unless_gone(self, call: Callable[[], bytes], step: int, rank: int) -> bytes:
        try:
            return call()
        except SidecarUnavailable as exc:
            # The sidecar went away mid-restore: this source is gone, the next one serves.
            raise ShardUnavailable(
                f"peer: step {step} rank {rank} not read: {exc}; the next source serves it"
            ) from exc

    # -- not for this tier ------------------------------------------------------------------------

    def put_shard(
        self,
        job_id: str,
        step: int,
        rank: int,
        src_path: Path,
        manifest: Manifest,
        verify_source: bool = True,
    ) -> int:
        raise TierError("the peer tier is filled by the sidecars' peer service, not written to")

    def delete_step(self, job_id: str, step: int, ranks: frozenset[int] | None = None) -> None:
        """No-op: each peer keeps its own copies (``peers.keep``)."""

    def quarantine(self, job_id: str, step: int, rank: int, reason: str) -> None:
        """No-op: peers are read-only; the reader skips the copy and falls back."""
        log.warning("peer copy of step %d rank %d rejected: %s", step, rank, reason)


def peer_source(
    client: SidecarClient, config: StrataConfig, note: Callable[[str], None] | None = None
) -> PeerSource | None:
    """The peer tier through ``client`` when ``config`` turns peers on and the sidecar has a
    peer tier; None otherwise (no peers configured, a sidecar without one or of an older
    version, or one that does not answer: logged, never raised). ``note``: told why a
    configured peer tier is not searched (for the restore's notes, ``RestoreResult.skipped``)."""
    if config.peers is None:
        return None
    try:
        info = client.peer_info()
    except TierError as exc:
        why = f"peer: not searched: the sidecar did not say whether it has a peer tier: {exc}"
        log.warning("strata: %s", why)
        if note is not None:
            note(why)
        return None
    if info is None or not info.enabled:
        why = (
            f"peer: not searched: peers are configured but the sidecar on {client.socket_path} "
            "serves no peer tier (a sidecar of an older version, or one started without the "
            "peers' configuration)"
        )
        log.info("strata: %s", why)
        if note is not None:
            note(why)
        return None
    return PeerSource(client, config.job_id, info.max_range)
