"""The global commit record, sealed records and incarnation lineage (issue 12), pure logic."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from strata.errors import CommitError, FormatError
from strata.format import layout
from strata.format.commit import StepCommit, build_commit, manifest_crc
from strata.format.incarnation import Incarnation, Lineage, new_incarnation_id
from strata.format.manifest import FORMAT_VERSION, Manifest
from strata.format.sealed import seal, unseal

JOB = "job.a"


def manifest(
    step: int, rank: int, world: int = 2, inc: str = "inc-a", crc: int | None = 7
) -> Manifest:
    return Manifest(
        job_id=JOB,
        step=step,
        rank=rank,
        world_size=world,
        writer_id="w",
        incarnation=inc,
        tree={},
        tensors=[],
        storages=[],
        data_nbytes=100 + rank,
        chunk_crc32c=[crc or 0],
        crc32c=crc,
    )


def shards(step: int, world: int = 2, inc: str = "inc-a") -> dict[int, tuple[Manifest, bytes]]:
    out = {}
    for r in range(world):
        m = manifest(step, r, world, inc)
        out[r] = (m, m.to_json())
    return out


def test_seal_round_trip_and_every_flipped_byte_is_caught() -> None:
    body = b'{"a":1,"b":[1,2,3]}'
    raw = seal(body)
    assert unseal(raw, "x") == body
    for i in range(len(raw) - 1):
        bad = bytearray(raw)
        bad[i] ^= 0x04
        with pytest.raises(FormatError):
            unseal(bytes(bad), "x")
    with pytest.raises(FormatError, match="not a sealed"):
        unseal(raw[: len(raw) // 2], "torn.json")
    with pytest.raises(FormatError, match="not a sealed"):
        unseal(body, "plain.json")


def test_commit_record_round_trip_names_every_shard() -> None:
    sh = shards(20)
    c = build_commit(JOB, 20, sh, writer_id="pod-0/1")
    assert c.format_version == FORMAT_VERSION == 2
    assert (c.incarnation, c.world_size, [s.rank for s in c.shards]) == ("inc-a", 2, [0, 1])
    assert c.shard(1).data_nbytes == 101 and c.shard(1).manifest_crc32c == manifest_crc(sh[1][1])
    back = StepCommit.from_bytes(c.to_bytes(), "commit.json")
    assert back == c and back.same_commit(c)
    back.check_identity(JOB, 20)
    with pytest.raises(CommitError, match="another step"):
        back.check_identity(JOB, 30)
    assert all(c.matches(m, raw) for m, raw in sh.values())
    replay = manifest(20, 0, inc="inc-b")
    assert not c.matches(replay, replay.to_json())
    changed = manifest(20, 0).model_copy(update={"crc32c": 8})
    assert not c.matches(changed, changed.to_json())


def test_corrupt_commit_record_is_refused_before_parsing() -> None:
    raw = bytearray(build_commit(JOB, 20, shards(20), writer_id="w").to_bytes())
    raw[raw.index(b'"world_size":2') + len('"world_size":')] = ord("3")
    with pytest.raises(CommitError, match="checksum mismatch"):
        StepCommit.from_bytes(bytes(raw), "steps/20/commit.json")


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: {0: shards(20)[0]}, r"lacks ranks \[1\]"),
        (lambda: {0: shards(20)[0], 1: shards(20, inc="inc-b")[1]}, "mixes shards of incarnations"),
        (lambda: {0: shards(20)[0], 1: shards(20, world=3)[1]}, "world sizes"),
        (lambda: {0: shards(20)[0], 1: shards(30)[1]}, "step 30 != 20"),
        (
            lambda: {r: (manifest(20, r, crc=None), b"{}") for r in range(2)},
            "no data checksum yet",
        ),
    ],
)
def test_step_is_not_committable(make: object, why: str) -> None:
    with pytest.raises(CommitError, match=why):
        build_commit(JOB, 20, make(), writer_id="w")  # type: ignore[operator]


def test_commit_of_another_incarnation_than_the_current_is_refused() -> None:
    with pytest.raises(CommitError, match="not the current"):
        build_commit(JOB, 20, shards(20, inc="old"), writer_id="w", incarnation="new")


def test_record_with_missing_rank_does_not_parse() -> None:
    c = build_commit(JOB, 20, shards(20), writer_id="w")
    body = c.model_dump(mode="json")
    body["shards"] = body["shards"][:1]
    with pytest.raises(CommitError, match=r"ranks 0\.\.1"):
        StepCommit.from_bytes(seal(json.dumps(body).encode()), "x")


def test_incarnation_record_and_layout() -> None:
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    i = new_incarnation_id(t0)
    assert i.startswith("20261201T000000000000Z-") and layout.INCARNATION_ID_RE.match(i)
    rec = Incarnation(job_id=JOB, id=i, parent=None, base_step=None, world_size=2, created=t0)
    assert Incarnation.from_bytes(rec.to_bytes(), "x") == rec
    key = layout.incarnation_key(JOB, i)
    assert key == f"{JOB}/incarnations/{i}.json"
    assert layout.parse_incarnation_name(key.rsplit("/", 1)[1]) == i
    assert layout.commit_key(JOB, 20) == f"{JOB}/steps/000000000020/commit.json"
    with pytest.raises(ValueError, match="not 1-64"):
        layout.incarnation_key(JOB, "../x")
    with pytest.raises(ValueError, match="not 1-64"):
        Incarnation(job_id=JOB, id="a/b", world_size=1)


def test_lineage_superseded_and_foreign_steps_are_dead() -> None:
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    a = Incarnation(job_id=JOB, id="a", world_size=2, created=t0)
    b = Incarnation(
        job_id=JOB, id="b", parent="a", base_step=10, world_size=2, created=t0 + timedelta(1)
    )
    c = Incarnation(
        job_id=JOB, id="c", parent="b", base_step=30, world_size=2, created=t0 + timedelta(2)
    )
    lin = Lineage([a, b, c])
    assert lin.current == "c"
    assert lin.live("a", 10) and not lin.live("a", 20)
    assert lin.live("b", 30) and not lin.live("b", 40)
    assert lin.live("c", 10**9)
    assert "superseded" in lin.why_dead("a", 20)
    # A fresh start supersedes everything before it.
    d = Incarnation(job_id=JOB, id="d", world_size=1, created=t0 + timedelta(3))
    fresh = Lineage([a, b, c, d])
    assert fresh.current == "d" and not fresh.live("c", 700) and fresh.live("d", 100)
    assert "does not descend" in fresh.why_dead("c", 700)
    # Following an explicit current incarnation; a parent without a record still links.
    assert Lineage([b], current="b").live("a", 10)
    assert Lineage([]).live("anything", 5)
