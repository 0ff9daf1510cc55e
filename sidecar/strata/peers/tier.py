"""``PeerTier``: restore a shard from the job's other sidecars (restore order RAM -> peer -> PVC
-> GCS). Read-only: the peers' own services fill it (:mod:`strata.peers.service`).

Sources of rank ``r``'s shard of step ``s``, tried in this order, each verified chunk by chunk:

1. a peer's own RAM tier that holds it (a rank that moved to another pod);
2. a full replica a peer holds (``replicate`` mode);
3. a rebuild from any ``k`` surviving units of each column's RS group (``erasure`` mode): the
   other members' chunks and the parity holders' chunks, decoded with zfec, each decoded chunk
   checked against the owner's manifest -- which survives in every holder's parity record.

A copy that fails verification (a lying or broken peer) is logged, noted and skipped; the next
source is tried. :meth:`list_steps` counts a rank as held only when some source exists, so a
loss beyond what the code tolerates makes the restore plan fall back to the PVC; the reason is in
:attr:`PeerTier.notes`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from strata.errors import ShardUnavailable, TierError
from strata.format import crc
from strata.format.manifest import Manifest
from strata.peers.directory import PeerDirectory
from strata.peers.erasure import decode
from strata.peers.pull import CorruptCopy, copy_shard, fetch_chunk, fetch_manifest
from strata.peers.transport import PeerError
from strata.peers.wire import MAX_RANGE, ParityColumn, ParityRecord, PeerInventory, locate
from strata.tiers.base import StepListing, Tier, parse_manifest

log = logging.getLogger(__name__)


class PeerTier(Tier):
    """The job's peers as a read-only tier named ``peer`` (see the module docstring)."""

    # A restore source (config.SourceName), not a configurable tier: the promotion and retention
    # code keyed on TierName never sees this tier, only restore does.
    name = "peer"  # type: ignore[assignment]

    def __init__(self, directory: PeerDirectory) -> None:
        self.directory = directory
        self.notes: list[str] = []
        """Why steps or ranks are not restorable from peers (unreachable, beyond tolerance)."""
        self._invs: dict[str, PeerInventory] = {}

    # -- listing ----------------------------------------------------------------------------------

    def _inventories(self, refresh: bool = True) -> dict[str, PeerInventory]:
        if refresh or not self._invs:
            self._invs, notes = self.directory.inventories()
            self.notes = list(notes)
        return self._invs

    def list_steps(self, job_id: str) -> dict[int, StepListing]:
        invs = self._inventories()
        ranks: dict[int, set[int]] = {}
        world: dict[int, int] = {}
        for inv in invs.values():
            shards = list(inv.ram) + [s for v in inv.replicas.values() for s in v]
            for s in shards:
                ranks.setdefault(s.step, set()).add(s.rank)
                world[s.step] = s.world_size
        for step in sorted({s for inv in invs.values() for s in inv.parity_steps}):
            records = self._records(step)
            if not records:
                continue
            rec = next(iter(records.values()))
            world[step] = rec.world_size
            for rank in rec.manifests:
                if rank in ranks.get(step, set()):
                    continue
                why = self._unrebuildable(rec, records, rank)
                if why is None:
                    ranks.setdefault(step, set()).add(rank)
                else:
                    self.notes.append(f"peer: step {step} rank {rank} cannot be rebuilt: {why}")
        for note in self.notes:
            log.warning("%s", note)
        return {s: StepListing(s, frozenset(r), world_size=world.get(s)) for s, r in ranks.items()}

    def _records(self, step: int) -> dict[str, ParityRecord]:
        out = {}
        for pid, inv in self._invs.items():
            if step in inv.parity_steps:
                try:
                    out[pid] = self.directory.parity_record(pid, step)
                except PeerError as exc:
                    self.notes.append(f"peer: parity record of step {step} from {pid}: {exc}")
        return out

    def _alive(self, peer: str, rec: ParityRecord) -> bool:
        """``peer`` still serves every shard of its unit of ``rec``'s step from its RAM."""
        inv = self._invs.get(peer)
        if inv is None:
            return False
        held = {s.rank for s in inv.ram if s.step == rec.step}
        return {seg.rank for seg in rec.units.get(peer, [])} <= held

    def _plan_column(
        self, rec: ParityRecord, records: Mapping[str, ParityRecord], owner: str, column: int
    ) -> tuple[list[str], int, dict[int, tuple[str, ParityColumn | None]]]:
        """The owner's group at ``column`` (members, m) and block number -> (peer, parity column)
        of every surviving unit (data blocks: ``None``). Holders that coded the column with
        different groups (a peer moved between their rounds) are grouped apart; the group with
        the most surviving units wins."""
        by_group: dict[tuple[str, ...], tuple[int, dict[int, tuple[str, ParityColumn | None]]]]
        by_group = {}
        for holder, r in records.items():
            for col in r.columns:
                if col.column == column and owner in col.members:
                    _m, parity = by_group.setdefault(tuple(col.members), (col.m, {}))
                    parity[len(col.members) + col.index] = (holder, col)
        best: tuple[list[str], int, dict[int, tuple[str, ParityColumn | None]]] = ([], 0, {})
        for members, (m, parity) in by_group.items():
            blocks = dict(parity)
            for j, p in enumerate(members):
                padding = locate(rec.units.get(p, []), column, rec.chunk_size) is None
                if p != owner and (padding or self._alive(p, rec)):
                    blocks[j] = (p, None)
            if not best[0] or len(blocks) - len(members) > len(best[2]) - len(best[0]):
                best = (list(members), m, blocks)
        return best

    def _unrebuildable(
        self, rec: ParityRecord, records: Mapping[str, ParityRecord], rank: int
    ) -> str | None:
        owner, seg = rec.owner_of(rank)
        first = seg.offset // rec.chunk_size
        for c in range(first, first + crc.n_chunks(seg.nbytes, rec.chunk_size)):
            members, _m, blocks = self._plan_column(rec, records, owner, c)
            if not members:
                return f"no parity of column {c} survives (its holders are gone)"
            if len(blocks) < len(members):
                lost = sorted(p for p in members if p != owner and not self._alive(p, rec))
                return (
                    f"column {c} needs {len(members)} of its group's units, {len(blocks)} survive "
                    f"(owner {owner} and peers {lost} lost, parity holders reachable: "
                    f"{len(blocks) - (len(members) - 1 - len(lost))}): more nodes lost than the "
                    "parity tolerates"
                )
        return None

    # -- reading ----------------------------------------------------------------------------------

    def copies(self, step: int, rank: int) -> list[tuple[str, str]]:
        """``(peer, URL base)`` of every full copy of the shard, in the order they are tried:
        peers' own RAM tiers, then replicas (peers in configuration order)."""
        self._inventories(refresh=False)
        out = []
        for pid, inv in self._invs.items():
            if any(s.step == step and s.rank == rank for s in inv.ram):
                out.append((pid, f"/v1/ram/{step}/{rank}"))
        for pid, inv in self._invs.items():
            for owner, shards in inv.replicas.items():
                if any(s.step == step and s.rank == rank for s in shards):
                    out.append((pid, f"/v1/replica/{owner}/{step}/{rank}"))
        return out

    def get_manifest(self, job_id: str, step: int, rank: int) -> Manifest:
        self._inventories(refresh=False)
        skipped = []
        for pid, base in self.copies(step, rank):
            try:
                return fetch_manifest(self.directory.client(pid), base, job_id, step, rank)[1]
            except ShardUnavailable as exc:
                skipped.append(str(exc))
        for rec in self._records(step).values():
            if rank in rec.manifests:
                raw = rec.manifests[rank].encode()
                return parse_manifest(raw, f"parity record of {rec.holder}", job_id, step, rank)
        raise ShardUnavailable(
            f"no peer holds rank {rank} of step {step}: " + ("; ".join(skipped) or "none listed")
        )

    def fetch_shard(
        self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True
    ) -> Manifest:
        """Copy (or rebuild) the shard into ``dst_path``, always verified (``verify`` is ignored:
        a peer's bytes are never trusted unchecked). Raises :class:`ShardUnavailable` listing
        every source tried."""
        self._inventories(refresh=False)
        skipped: list[str] = []
        for pid, base in self.copies(step, rank):
            client = self.directory.client(pid)
            try:
                _raw, m = fetch_manifest(client, base, job_id, step, rank)
                copy_shard(client, base, m, Path(dst_path))
                return m
            except CorruptCopy as exc:
                log.warning("lying or broken peer skipped: %s", exc)
                self.notes.append(f"peer {pid}: corrupt copy skipped: {exc}")
                skipped.append(f"{exc}")
            except ShardUnavailable as exc:
                skipped.append(str(exc))
        try:
            return self._rebuild(job_id, step, rank, Path(dst_path), skipped)
        except ShardUnavailable as exc:
            skipped.append(str(exc))
        raise ShardUnavailable(
            f"no peer could serve rank {rank} of step {step}: " + "; ".join(skipped)
        )

    def read_range(self, job_id: str, step: int, rank: int, offset: int, nbytes: int) -> bytes:
        """Bytes ``[offset, offset + nbytes)`` of the shard, NOT verified (the caller checks
        them against the manifest: :func:`strata.tiers.references.read_logical`), by ranged
        GETs (at most :data:`~strata.peers.wire.MAX_RANGE` bytes each) of the first full copy
        that answers: a peer's own RAM tier, then replicas. A shard that only an erasure
        rebuild can serve is rebuilt whole once (verified) and read locally from then on
        (:meth:`Tier.read_range`'s default). Raises :class:`ShardUnavailable` when no peer can
        serve it."""
        if nbytes <= 0:
            return b""
        self._inventories(refresh=False)
        for pid, base in self.copies(step, rank):
            client = self.directory.client(pid)
            parts: list[bytes] = []
            done = 0
            try:
                while done < nbytes:
                    want = min(MAX_RANGE, nbytes - done)
                    piece = client.get(f"{base}/data", {"offset": offset + done, "length": want})
                    parts.append(piece)
                    done += len(piece)
                    if len(piece) < want:
                        break  # the object ends first
            except PeerError as exc:
                self.notes.append(f"peer {pid}: ranged read of step {step} rank {rank}: {exc}")
                continue
            return parts[0] if len(parts) == 1 else b"".join(parts)
        return super().read_range(job_id, step, rank, offset, nbytes)

    def _rebuild(
        self, job_id: str, step: int, rank: int, dst: Path, skipped: list[str]
    ) -> Manifest:
        records = self._records(step)
        rec = next((r for r in records.values() if rank in r.manifests), None)
        if rec is None:
            raise ShardUnavailable(f"no parity of step {step} covers rank {rank}")
        m = parse_manifest(rec.manifests[rank].encode(), "parity record", job_id, step, rank)
        owner, seg = rec.owner_of(rank)
        B = rec.chunk_size
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o640)
        try:
            for i in range(crc.n_chunks(m.data_nbytes, B)):
                c = seg.offset // B + i
                data = self._rebuild_chunk(rec, records, owner, c, job_id, skipped)
                n = min(B, m.data_nbytes - i * B)
                if crc.crc32c(data[:n]) != (m.chunk_crc32c or [])[i]:
                    raise ShardUnavailable(
                        f"rebuilt chunk {i} of rank {rank} step {step} does not match its manifest"
                    )
                os.pwrite(fd, data[:n], i * B)
        finally:
            os.close(fd)
        return m

    def _rebuild_chunk(
        self,
        rec: ParityRecord,
        records: Mapping[str, ParityRecord],
        owner: str,
        column: int,
        job_id: str,
        skipped: list[str],
    ) -> bytes:
        members, m, blocks = self._plan_column(rec, records, owner, column)
        k = len(members)
        got: dict[int, bytes] = {}
        for num in sorted(blocks):
            if len(got) == k:
                break
            peer, col = blocks[num]
            try:
                got[num] = self._block(rec, peer, col, column)
            except (ShardUnavailable, PeerError) as exc:
                if isinstance(exc, CorruptCopy):
                    log.warning("lying or broken peer skipped: %s", exc)
                    self.notes.append(f"peer {peer}: corrupt unit skipped: {exc}")
                skipped.append(str(exc))
        if len(got) < k:
            raise ShardUnavailable(
                f"column {column}: only {len(got)} of the {k} units needed to rebuild {owner}'s "
                "chunk could be read"
            )
        return decode(got, k, m)[members.index(owner)]

    def _block(self, rec: ParityRecord, peer: str, col: ParityColumn | None, column: int) -> bytes:
        B = rec.chunk_size
        client = self.directory.client(peer)
        if col is not None:
            data = client.get(f"/v1/parity/{rec.step}/data", {"offset": col.offset, "length": B})
            if crc.crc32c(data) != col.crc32c:
                raise CorruptCopy(f"peer {peer}: parity chunk of column {column} is corrupt")
            return data
        where = locate(rec.units[peer], column, B)
        if where is None:
            return bytes(B)
        rank, off, _n = where
        mm = parse_manifest(
            rec.manifests[rank].encode(), "parity record", rec.job_id, rec.step, rank
        )
        data = fetch_chunk(client, f"/v1/ram/{rec.step}/{rank}", mm, off // B)
        return data + bytes(B - len(data))

    def close(self) -> None:
        """Close the kept-alive connections to the peers; remove rebuilt shards kept for
        ranged reads."""
        self.drop_fetched()
        self.directory.close()

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
        """No-op: a bad peer copy is skipped by :meth:`fetch_shard` itself; peers are read-only."""
        log.warning("peer copy of step %d rank %d rejected: %s", step, rank, reason)
