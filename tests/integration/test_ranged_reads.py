"""Ranged reads (issue 29 item 3): a resharding restore reads only the byte ranges it needs from
every tier (``pread`` of RAM and PVC files, ranged GETs on fake-gcs-server with the real client),
an incremental copy's referenced chunks from its base, every chunk verified.

Bytes are counted where they leave the tier (:meth:`Tier.read_range`) by tiers that add a
counter to the real ones; the restores are real gloo jobs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from strata.errors import ShardCorrupt
from tests.fixtures.checkpoints import flip_byte
from tests.integration.test_sharded import promote, run_script

pytestmark = pytest.mark.integration
JOB = "ns.ranged"
MIB = 1024 * 1024

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from strata.client import Checkpointer

mode, ram_root, pvc, bucket, step, out = sys.argv[1:7]
step = int(step)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
SHAPES = {"w1": (768, 4096), "w2": (256, 4096), "w3": (512, 1024)}  # 12 MiB, 4 MiB, 2 MiB fp32

def global_tensors(s):
    g = torch.Generator().manual_seed(50 + s)
    return {k: torch.randn(*v, generator=g) for k, v in SHAPES.items()}

def state(s, zero=False):
    gt = global_tensors(s)
    if zero:
        gt = {k: torch.zeros_like(v) for k, v in gt.items()}
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in gt.items()}
    return {"model": model, "per_rank": torch.full((1024,), float(rank)), "step": s}

if bucket:
    os.environ["STRATA_GCS_BUCKET"] = bucket
kw = dict(job_id="ns.ranged", ram_dir=os.path.join(ram_root, f"node-{rank}"),
          pvc_dir=pvc or None, allow_fresh_start=True, reshard=True)
result = {"rank": rank}
with Checkpointer(**kw) as c:
    if mode == "save":
        assert c.save(step, state(step)), c.last_error
        c.wait()
    else:
        live = state(0, zero=True)
        res = c.restore(live)
        gt = global_tensors(res.step)
        result["step"] = res.step
        result["nbytes"] = res.nbytes
        result["skipped"] = res.skipped
        result["equal"] = all(
            torch.equal(live["model"][k].full_tensor(), gt[k]) for k in gt
        )
        result["per_rank"] = live["per_rank"][:2].tolist()
        result["needed"] = sum(
            t.to_local().numel() * 4 for t in live["model"].values()
        ) + 1024 * 4
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def _run(
    mode: str, world: int, ram: Path, out: Path, step: int = 0, pvc: Path | None = None, **env: str
) -> list[dict[str, Any]]:
    bucket = env.get("STRATA_GCS_BUCKET", "")
    args = [mode, str(ram), str(pvc or ""), bucket, str(step)]
    return run_script(WORKER, args, world, out, env=env or None)


def _check(got: list[dict[str, Any]], step: int, saved_world: int) -> None:
    for r in got:
        assert r["step"] == step and r["equal"], r
        assert any(f"resharded from world size {saved_world}" in n for n in r["skipped"]), r
        # per-rank values: from the saved rank of the same number, or rank % saved world size
        assert r["per_rank"] == [float(r["rank"] % saved_world)] * 2, r


def test_two_ranks_to_one_from_the_pvc_reads_what_it_needs(shm_dir: Path, tmp_path: Path) -> None:
    """2 -> 1 needs every sharded byte once and rank 0's per-rank values: read ~1.0x, where the
    whole saved shard of rank 0 and then the slices (~1.5x) were read before."""
    from strata.tiers.posix import PosixTier

    pvc = tmp_path / "pvc"
    _run("save", 2, shm_dir / "old", tmp_path / "o", step=7, pvc=pvc)
    promote(shm_dir / "old", 2, 7, PosixTier(pvc), job=JOB)
    shutil.rmtree(shm_dir / "old")
    got = _run("restore", 1, shm_dir / "new", tmp_path / "o2", pvc=pvc)
    _check(got, 7, 2)
    assert got[0]["nbytes"] <= 1.1 * got[0]["needed"], got[0]


def test_two_ranks_to_four_from_the_pvc_reads_what_it_needs(shm_dir: Path, tmp_path: Path) -> None:
    """2 -> 4 (growth): each new rank needs half of each saved chunk of one saved rank (0.5-3 MiB
    slices) and 4 KiB of per-rank values. Verified by the 128 KiB sub-chunk CRCs its manifest
    records, that costs ~1.05x (the per-rank values' piece); by whole 4 MiB chunks it was ~2x."""
    from strata.tiers.posix import PosixTier

    pvc = tmp_path / "pvc"
    _run("save", 2, shm_dir / "old", tmp_path / "o", step=5, pvc=pvc)
    promote(shm_dir / "old", 2, 5, PosixTier(pvc), job=JOB)
    shutil.rmtree(shm_dir / "old")
    got = _run("restore", 4, shm_dir / "new", tmp_path / "o2", pvc=pvc)
    _check(got, 5, 2)
    for r in got:
        assert r["nbytes"] <= 1.1 * r["needed"], r
    m = PosixTier(pvc).get_manifest(JOB, 5, 0)
    assert m.sub_crc32c is not None and m.sub_crc32c.size == 128 * 1024, m.sub_crc32c


def test_two_ranks_to_four_from_gcs_reads_half_of_each_saved_chunk(
    shm_dir: Path, tmp_path: Path, gcs_emulator: Any, gcs_bucket: str
) -> None:
    """2 -> 4 from GCS alone: each new rank needs half of one saved rank's chunks, fetched by
    ranged GETs (before: the per-rank values' whole shard, then every owner's whole storages:
    twice the saved shard)."""
    from strata.tiers.gcs import GcsTier

    env = {"STRATA_GCS_BUCKET": gcs_bucket, "STORAGE_EMULATOR_HOST": gcs_emulator.endpoint}
    _run("save", 2, shm_dir / "old", tmp_path / "o", step=9, **env)
    with GcsTier(gcs_emulator.tier_config(gcs_bucket), writer_id="test") as gcs:
        promote(shm_dir / "old", 2, 9, gcs, job=JOB)
        saved = [gcs.get_manifest(JOB, 9, r).data_nbytes for r in range(2)]
    shutil.rmtree(shm_dir / "old")
    got = _run("restore", 4, shm_dir / "new", tmp_path / "o2", **env)
    _check(got, 9, 2)
    for r in got:
        # Its half of each chunk of saved rank r // 2, rounded out to the 4 MiB checksum chunks
        # that verify it (its slices are 0.5-3 MiB here, so the rounding doubles them; a 1.1x
        # bound needs slices far larger than a chunk): at most that saved shard, plus the one
        # checksum chunk of saved rank r % 2 holding its per-rank values.
        per_rank_chunk = 0 if r["rank"] % 2 == r["rank"] // 2 else 4 * MIB
        assert r["nbytes"] <= saved[r["rank"] // 2] + per_rank_chunk, (r, saved)


# -- read_logical on real tiers ----------------------------------------------------------------


def _counting(tier_cls: type, *args: Any, **kwargs: Any) -> Any:
    """A real tier of ``tier_cls`` that also counts the bytes its ranged reads return."""

    class Counting(tier_cls):  # type: ignore[misc]
        read_bytes = 0
        fetched_bytes = 0
        """Bytes of the whole data objects fetched (``fetch_shard``)."""

        def read_range(self, job_id: str, step: int, rank: int, offset: int, n: int) -> bytes:
            data: bytes = super().read_range(job_id, step, rank, offset, n)
            type(self).read_bytes += len(data)
            return data

        def fetch_shard(self, *args: Any, **kwargs: Any) -> Any:
            m = super().fetch_shard(*args, **kwargs)
            type(self).fetched_bytes += m.data_nbytes
            return m

    return Counting(*args, **kwargs)


def _incremental_steps(shm_dir: Path, tmp_path: Path, dst: Any) -> tuple[Any, Any, bytes]:
    """Save steps 1 and 2 (one of six 4 MiB tensors changed), promote both to ``dst`` with the
    sidecar's engine: step 2 becomes an incremental copy of step 1. Returns (manifest of step 2
    in ``dst``, the RAM tier, the logical bytes of step 2)."""
    import torch

    from strata.client import Checkpointer
    from strata.config import Interval, PvcTierConfig, RamTierConfig, StrataConfig
    from strata.sidecar.promotion import PromotionEngine
    from strata.tiers.ram import RamTier

    ram_dir = shm_dir / "ram"
    state = {f"t{i}": torch.randn(MIB) for i in range(6)}  # 4 MiB each: one chunk each
    config = StrataConfig(
        job_id=JOB,
        ram=RamTierConfig(path=str(ram_dir), keep=2),
        pvc=PvcTierConfig(path=str(tmp_path / "unused"), every=Interval(steps=1)),
        writer_id="test",
    )
    ram = RamTier(ram_dir)
    with Checkpointer(job_id=JOB, ram_dir=ram_dir, keep=2, raise_on_error=True) as ck:
        for step in (1, 2):
            if step == 2:
                state["t3"] += 1.0
            assert ck.save(step, state)
            ck.wait()
            engine = PromotionEngine(config, ram, {"pvc": dst}, local_ranks=[0])
            assert "pvc" in engine.promote_once(force_tier="pvc").promoted
        m = dst.get_manifest(JOB, 2, 0)
        assert m.refs is not None and m.refs.base_step == 1, "step 2 should be incremental"
        path = ram.data_path(JOB, 2, 0)
        assert path is not None
        logical = path.read_bytes()[: m.refs.logical_nbytes]
    return m, ram, logical


def test_read_logical_of_an_incremental_copy_reads_only_the_range(
    shm_dir: Path, tmp_path: Path
) -> None:
    from strata.tiers.posix import PosixTier
    from strata.tiers.references import read_logical

    pvc = _counting(PosixTier, tmp_path / "pvc", "pvc")
    m, _ram, logical = _incremental_steps(shm_dir, tmp_path, pvc)
    cs = m.chunk_size
    type(pvc).read_bytes = 0
    # chunks 2-4: chunk 3 is the step's own (changed), 2 and 4 come from the base (step 1)
    got = read_logical(pvc, JOB, 2, 0, m, 2 * cs, 5 * cs)
    assert bytes(got) == logical[2 * cs : 5 * cs]
    assert type(pvc).read_bytes == 3 * cs
    # a flipped byte in a referenced chunk of the base is refused, naming the base
    base = pvc.data_path(JOB, 1, 0)
    flip_byte(base, 4 * cs + 10)
    with pytest.raises(ShardCorrupt, match="base step 1"):
        read_logical(pvc, JOB, 2, 0, m, 4 * cs, 5 * cs)
    # chunks before it still read and verify
    assert bytes(read_logical(pvc, JOB, 2, 0, m, 0, cs)) == logical[:cs]
    # a truncated stored object is refused as truncated
    own = pvc.data_path(JOB, 2, 0)
    with open(own, "r+b") as f:
        f.truncate(cs // 2)
    with pytest.raises(ShardCorrupt, match="truncated"):
        read_logical(pvc, JOB, 2, 0, m, 3 * cs, 4 * cs)


def test_read_logical_verifies_parts_of_chunks_by_their_sub_chunk_crcs(
    shm_dir: Path, tmp_path: Path
) -> None:
    """A part of a chunk costs its own 128 KiB pieces, from the step's own object and from its
    base alike; a flipped byte fails only the piece it is in; sub-chunk CRCs that do not combine
    to their chunk's CRC32C are refused; a manifest without them is read by whole chunks."""
    from strata.format.manifest import SubChunkCrcs
    from strata.tiers.posix import PosixTier
    from strata.tiers.references import chunk_span, read_logical

    pvc = _counting(PosixTier, tmp_path / "pvc", "pvc")
    m, _ram, logical = _incremental_steps(shm_dir, tmp_path, pvc)
    cs = m.chunk_size
    assert m.sub_crc32c is not None
    g = m.sub_crc32c.size
    assert g == 128 * 1024 and cs % g == 0
    for lo, hi in ((3 * cs + g, 3 * cs + 3 * g), (2 * cs + g, 2 * cs + 2 * g)):  # own; base
        type(pvc).read_bytes = 0
        assert bytes(read_logical(pvc, JOB, 2, 0, m, lo, hi)) == logical[lo:hi]
        assert type(pvc).read_bytes == hi - lo
    assert chunk_span(m, 3 * cs + g + 5, 10) == (3 * cs + g, 3 * cs + 2 * g)
    # a flipped byte in a referenced piece of the base: that piece fails, its neighbour reads
    flip_byte(pvc.data_path(JOB, 1, 0), 2 * cs + g + 10)
    with pytest.raises(ShardCorrupt, match="base step 1"):
        read_logical(pvc, JOB, 2, 0, m, 2 * cs + g, 2 * cs + 2 * g)
    assert (
        bytes(read_logical(pvc, JOB, 2, 0, m, 2 * cs, 2 * cs + g)) == logical[2 * cs : 2 * cs + g]
    )
    # sub-chunk CRCs that do not combine to their chunk's CRC32C are not trusted
    values = list(m.sub_crc32c.values())
    k0 = 3 * cs // g
    values[k0], values[k0 + 1] = values[k0 + 1], values[k0]
    swapped = m.model_copy(update={"sub_crc32c": SubChunkCrcs.of(values, g)})
    with pytest.raises(ShardCorrupt, match="do not combine"):
        read_logical(pvc, JOB, 2, 0, swapped, 3 * cs, 3 * cs + g)
    # a manifest without them (written before they existed): whole chunks, as before
    old = m.model_copy(update={"sub_crc32c": None})
    assert chunk_span(old, 3 * cs + g + 5, 10) == (3 * cs, 4 * cs)
    with pytest.raises(ValueError, match="not aligned"):
        read_logical(pvc, JOB, 2, 0, old, 3 * cs + g, 3 * cs + 2 * g)
    type(pvc).read_bytes = 0
    assert bytes(read_logical(pvc, JOB, 2, 0, old, 3 * cs, 4 * cs)) == logical[3 * cs : 4 * cs]
    assert type(pvc).read_bytes == cs


def test_read_logical_from_gcs_transfers_only_the_range(
    shm_dir: Path, tmp_path: Path, gcs_emulator: Any, gcs_bucket: str
) -> None:
    from strata.tiers.gcs import GcsTier
    from strata.tiers.references import read_logical

    gcs = _counting(GcsTier, gcs_emulator.tier_config(gcs_bucket), writer_id="test")
    try:
        m, _ram, logical = _incremental_steps(shm_dir, tmp_path, gcs)
        cs = m.chunk_size
        type(gcs).read_bytes = 0
        got = read_logical(gcs, JOB, 2, 0, m, 3 * cs, 5 * cs)
        assert bytes(got) == logical[3 * cs : 5 * cs]
        assert type(gcs).read_bytes == 2 * cs
        with pytest.raises(ValueError, match="not aligned"):
            read_logical(gcs, JOB, 2, 0, m, 10, cs)
    finally:
        gcs.close()


def test_incremental_restore_from_gcs_reads_only_the_chunks_it_references_of_its_base(
    shm_dir: Path, tmp_path: Path, gcs_emulator: Any, gcs_bucket: str
) -> None:
    """Reassembling an incremental copy from GCS transfers the state once: the base's referenced
    chunks by ranged GETs and the step's own chunk, not the whole base and then the step's
    chunk over it (7 chunks for a 6-chunk state here); a corrupt referenced chunk of the base
    is refused, naming the base."""
    from strata.format import layout
    from strata.tiers.gcs import GcsTier
    from strata.tiers.references import fetch_full

    gcs = _counting(GcsTier, gcs_emulator.tier_config(gcs_bucket), writer_id="test")
    try:
        m, _ram, logical = _incremental_steps(shm_dir, tmp_path, gcs)
        assert m.refs is not None
        cs = m.chunk_size
        type(gcs).read_bytes = type(gcs).fetched_bytes = 0
        dst = tmp_path / "full"
        full = fetch_full(gcs, JOB, 2, 0, m, dst)
        assert dst.read_bytes()[: len(logical)] == logical
        assert full.crc32c == m.refs.logical_crc32c and full.refs is None
        assert type(gcs).read_bytes == len(m.refs.chunks) * cs
        assert type(gcs).read_bytes + type(gcs).fetched_bytes == len(logical)
        # the base's object rewritten behind Strata's back: a referenced chunk no longer matches
        blob = (
            gcs_emulator.client()
            .bucket(gcs_bucket)
            .blob(gcs.object_name(layout.data_key(JOB, 1, 0)))
        )
        bad = bytearray(blob.download_as_bytes())
        bad[4 * cs + 10] ^= 0xFF
        blob.upload_from_string(bytes(bad))
        with pytest.raises(ShardCorrupt, match=r"base step 1 .*chunk 4 referenced"):
            fetch_full(gcs, JOB, 2, 0, m, tmp_path / "again", quarantine=False)
    finally:
        gcs.close()
