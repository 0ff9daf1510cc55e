"""Sharded tensors in the format (issue 13), pure logic: the owner rule of replicated chunks, the
manifest's sharded entries, the commit record's global layout, slice arithmetic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from strata.format import codec, placement
from strata.format.commit import build_commit
from strata.format.manifest import Manifest

JOB = "job.s"


def encode_as(
    rank: int, world: int, state: Mapping[str, Any], replicated: bool | set[str] = True
) -> tuple[Manifest, bytearray]:
    enc = codec.encode(state, rank=rank, world_size=world, replicated=replicated)
    data = bytearray(enc.data_nbytes)
    codec.write_data(enc, data)
    m = enc.manifest(job_id=JOB, step=1, rank=rank, world_size=world, writer_id="w")
    crcs, whole = placement_crcs(data)
    return m.model_copy(update={"chunk_crc32c": crcs, "crc32c": whole}), data


def placement_crcs(data: bytearray) -> tuple[list[int], int]:
    from strata.format.crc import chunk_crcs

    return chunk_crcs(data, len(data))


def test_replicated_tensors_are_written_once_and_spread_evenly() -> None:
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}
    manifests = [encode_as(r, 4, state)[0] for r in range(4)]
    owners: dict[str, list[int]] = {}
    for m in manifests:
        assert len(m.sharded) == 8
        for e in m.sharded:
            assert e.global_shape == [256] and e.offsets == [0] and e.lengths == [256]
            if e.tensor is not None:
                assert e.owner == m.rank
                owners.setdefault(e.path, []).append(m.rank)
    # every tensor once, and every rank owns 2 of the 8 equal tensors (the owner rule balances)
    assert sorted(owners) == sorted(f"state['w{i}']" for i in range(8))
    assert all(len(v) == 1 for v in owners.values())
    per_rank = [len([v for v in owners.values() if v == [r]]) for r in range(4)]
    assert per_rank == [2, 2, 2, 2]
    # every rank records the same owner for each tensor (computed locally, no collective)
    for i in range(8):
        assert len({m.sharded[i].owner for m in manifests}) == 1
    total = sum(m.data_nbytes for m in manifests)
    assert 8 * 256 * 4 <= total <= 8 * 256 * 4 + 8 * 63


def test_only_the_named_keys_are_replicated() -> None:
    state = {"model": {"w": torch.ones(10)}, "rng": torch.zeros(5, dtype=torch.uint8)}
    m0, _ = encode_as(0, 2, state, replicated={"model"})
    m1, _ = encode_as(1, 2, state, replicated={"model"})
    assert [e.path for e in m0.sharded] == ["state['model']['w']"]
    # the per-rank RNG state is a plain tensor on both ranks; the model is stored once
    assert len(m0.tensors) + len(m1.tensors) == 3
    assert codec.encode(state, rank=0, world_size=2).sharded == []  # nothing declared


def test_commit_record_describes_every_tensor_once() -> None:
    state = {"a": torch.arange(6.0), "b": torch.ones(3, 3)}
    shards = {}
    for r in range(3):
        m, _ = encode_as(r, 3, state)
        shards[r] = (m, m.to_json())
    c = build_commit(JOB, 1, shards, writer_id="w")
    assert [t.path for t in c.tensors] == ["state['a']", "state['b']"]
    for t in c.tensors:
        assert len(t.chunks) == 1
        owner = t.chunks[0].rank
        assert (
            shards[owner][0]
            .sharded[[e.path for e in shards[owner][0].sharded].index(t.path)]
            .tensor
            is not None
        )
    assert c.tensors[1].global_shape == [3, 3] and c.tensors[1].dtype == "float32"


def test_loading_a_replicated_shard_without_a_resolver_gives_the_chunk_or_none() -> None:
    state = {"a": torch.arange(6.0), "b": torch.ones(2)}
    loaded = []
    for r in range(2):
        m, data = encode_as(r, 2, state)
        loaded.append(codec.load(m, data))
    for key in ("a", "b"):
        got = [x[key] for x in loaded]
        assert sum(g is not None for g in got) == 1
        assert torch.equal(next(g for g in got if g is not None), state[key])


def test_overlap_and_sub() -> None:
    assert placement.overlap(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert placement.overlap(((0,), (2,)), ((2,), (2,))) is None
    t = torch.arange(16).reshape(4, 4)
    chunk = t[2:, 2:]
    piece = placement.sub(chunk, (2, 2), ((3, 2), (1, 2)))
    assert torch.equal(piece, t[3:4, 2:4])
