"""Erasure-coding round of one parity holder (``peers.mode: erasure``).

The step coded is the newest one that EVERY peer holds checksummed in its own RAM tier (all peers
must be up; members keep it while it is coded, hence ``ram.keep >= 2``). For every chunk column
where :func:`~strata.peers.placement.column_groups` makes this node a parity holder, it pulls the
group members' unit chunks (each verified against its manifest's chunk CRC32C; padding is zeros,
and a column that is padding for every member is skipped), computes its parity block with zfec
and appends it to ``parity.data``; the :class:`~strata.peers.wire.ParityRecord` (with every
member's raw manifests) is committed last. The ``k`` chunks of a column are fetched in parallel.
Memory while coding: ``k + 1`` chunks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from strata.errors import ShardCorrupt, ShardUnavailable
from strata.format import crc
from strata.format.manifest import Manifest
from strata.peers.erasure import encode_parity
from strata.peers.placement import ColumnGroup, PeerSite, column_groups, group_sizes
from strata.peers.pull import fetch_chunk, fetch_manifest
from strata.peers.wire import (
    ParityColumn,
    ParityRecord,
    PeerInventory,
    Segment,
    locate,
    unit_columns,
    unit_layout,
)
from strata.tiers.base import parse_manifest
from strata.tiers.slots import SlotLease

if TYPE_CHECKING:
    from strata.peers.service import PeerService, RoundResult


def encode_round(
    svc: PeerService,
    invs: Mapping[str, PeerInventory],
    sites: list[PeerSite],
    result: RoundResult,
) -> None:
    """Encode this node's parity of the newest step held by every peer, if not done yet."""
    everyone = {**invs, svc.me.id: svc.inventory()}
    missing = [s.id for s in sites if s.id not in everyone]
    if missing:
        result.notes.append(f"erasure coding waits: peers {missing} unreachable")
        return
    # Steps every rank of the job has committed and checksummed somewhere (ranks checksum one by
    # one: a step some rank still lacks would be coded without it, for good).
    ranks: dict[int, set[int]] = {}
    world: dict[int, int] = {}
    for p in sites:
        for s in everyone[p.id].ram:
            ranks.setdefault(s.step, set()).add(s.rank)
            world[s.step] = s.world_size
    common = [s for s, rs in ranks.items() if rs >= set(range(world[s]))]
    if not common:
        return
    step = max(common)
    done = svc.store.parity_steps()
    if step in done:
        return
    try:
        record = _encode_step(svc, everyone, sites, step, result)
    except (ShardUnavailable, OSError, ValueError) as exc:
        if isinstance(exc, ShardCorrupt):
            svc.emit("corrupt_peer", step=step, message=str(exc))
        result.notes.append(f"erasure coding of step {step} abandoned: {exc}")
        return
    result.encoded.append(step)
    svc.emit("encoded", step=step, nbytes=record.data_nbytes, columns=len(record.columns))
    kept = set(svc.store.parity_steps()[-svc.config.keep :])
    for old in svc.store.all_parity_steps():
        if old not in kept and old < step:
            svc.store.delete_parity_step(old)


def _encode_step(
    svc: PeerService,
    everyone: Mapping[str, PeerInventory],
    sites: list[PeerSite],
    step: int,
    result: RoundResult,
) -> ParityRecord:
    job, me = svc.job_id, svc.me.id
    raws: dict[int, bytes] = {}
    manifests: dict[int, Manifest] = {}
    owners: dict[int, str] = {}
    for site in sites:
        for shard in everyone[site.id].ram:
            if shard.step != step:
                continue
            base = f"/v1/ram/{step}/{shard.rank}"
            if site.id == me:
                raw = svc.ram.manifest_path(job, step, shard.rank).read_bytes()
                man = parse_manifest(raw, base, job, step, shard.rank)
            else:
                client = svc.directory.client(site.id)
                raw, man = fetch_manifest(client, base, job, step, shard.rank)
            if shard.rank in owners:
                raise ValueError(f"rank {shard.rank} is held by {owners[shard.rank]} and {site.id}")
            raws[shard.rank], manifests[shard.rank], owners[shard.rank] = raw, man, site.id
    chunk = next(iter(manifests.values())).chunk_size
    worlds = {m.world_size for m in manifests.values()}
    if len(worlds) != 1:
        raise ValueError(f"step {step} mixes world sizes {sorted(worlds)}")
    units = {
        s.id: unit_layout([manifests[r] for r, o in owners.items() if o == s.id], chunk)
        for s in sites
    }
    ncols = max(unit_columns(u, chunk) for u in units.values())
    k, m = svc.config.data_shards, svc.config.parity_shards
    # Parity spreads evenly: about G * m of every N columns land on each peer (+1 for the rest).
    share = -(-ncols * len(group_sizes(len(sites), k)) * m // len(sites)) + 1
    if not svc.fits(share * chunk, result, f"parity of step {step}"):
        raise ValueError("no room for parity in the RAM tier's size limit")
    layouts: dict[int, list[ColumnGroup]] = {}
    columns: list[ParityColumn] = []
    tmp = svc.store.parity_temp(step)
    try:
        # The k chunks of a column come from k peers: fetched in parallel (latency-bound).
        with open(tmp, "wb") as f, ThreadPoolExecutor(max_workers=min(8, k)) as pool:
            for c in range(ncols):
                if c % len(sites) not in layouts:
                    layouts[c % len(sites)] = column_groups(sites, k, m, c)
                groups = layouts[c % len(sites)]
                for g in groups:
                    if me not in g.holders:
                        continue
                    if all(locate(units[p], c, chunk) is None for p in g.members):
                        continue
                    blocks = list(
                        pool.map(
                            lambda p, c=c: _unit_chunk(svc, p, units[p], manifests, step, c, chunk),
                            g.members,
                        )
                    )
                    index = g.holders.index(me)
                    parity = encode_parity(blocks, m, [index])[0]
                    columns.append(
                        ParityColumn(
                            column=c,
                            members=list(g.members),
                            m=m,
                            index=index,
                            offset=f.tell(),
                            crc32c=crc.crc32c(parity),
                        )
                    )
                    f.write(parity)
            nbytes = f.tell()
        record = ParityRecord(
            job_id=job,
            holder=me,
            step=step,
            world_size=worlds.pop(),
            chunk_size=chunk,
            units=units,
            manifests={r: raw.decode() for r, raw in raws.items()},
            columns=columns,
            data_nbytes=nbytes,
        )
        svc.store.commit_parity(step, tmp, record)
    finally:
        if tmp.exists():
            os.unlink(tmp)
    return record


def _unit_chunk(
    svc: PeerService,
    peer: str,
    unit: list[Segment],
    manifests: Mapping[int, Manifest],
    step: int,
    column: int,
    chunk: int,
) -> bytes:
    """Chunk ``column`` of ``peer``'s unit, verified, padded with zeros to ``chunk`` bytes."""
    where = locate(unit, column, chunk)
    if where is None:
        return bytes(chunk)
    rank, off, _n = where
    m = manifests[rank]
    if peer == svc.me.id:
        data = _local_chunk(svc, step, rank, m, off // chunk)
    else:
        data = fetch_chunk(svc.directory.client(peer), f"/v1/ram/{step}/{rank}", m, off // chunk)
    return data + bytes(chunk - len(data)) if len(data) < chunk else data


def _local_chunk(svc: PeerService, step: int, rank: int, m: Manifest, index: int) -> bytes:
    off = index * m.chunk_size
    n = min(m.chunk_size, m.data_nbytes - off)
    with (
        SlotLease(svc.ram, svc.job_id, step, rank, timeout=2.0) as lease,
        open(lease.path, "rb") as f,
    ):
        data = os.pread(f.fileno(), n, off)
    if crc.crc32c(data) != (m.chunk_crc32c or [])[index]:
        raise ShardCorrupt(f"own RAM shard step {step} rank {rank} chunk {index} is corrupt")
    return data
