"""Issue 11, failure 3: manifests are sealed; a damaged manifest is a corrupt copy on every tier.

Single-bit flips anywhere in a committed manifest (RAM, PVC, GCS) used to restore wrong state
silently (a flipped learning rate, key, stride, offset) or make ``restore()`` raise
``CodecError``. Now the seal (CRC32C trailer) is checked on the raw bytes before any field is
read: the copy is quarantined and the next tier, or an older step, serves -- bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from google.cloud import storage

from strata.client import Checkpointer
from strata.config import StrataConfig
from strata.errors import ManifestError, ShardCorrupt, ShardUnavailable
from strata.format import layout
from strata.format.manifest import PARSED_KEEP, Manifest
from strata.format.sealed import seal, unseal
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from tests.fixtures.gcs import GcsEmulator
from tests.integration.test_client import JOB, Trainer, promote, same_weights

pytestmark = pytest.mark.integration


def flip_bit(raw: bytes, rng: random.Random) -> tuple[bytes, int]:
    """``raw`` with one random bit flipped, and the bit index."""
    bit = rng.randrange(len(raw) * 8)
    b = bytearray(raw)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b), bit


def flip_gcs_object(client: storage.Client, bucket: str, name: str, rng: random.Random) -> int:
    """Rewrite a GCS object with one bit flipped, keeping its metadata (a damaged copy)."""
    blob = client.bucket(bucket).get_blob(name)
    assert blob is not None, name
    raw, bit = flip_bit(blob.download_as_bytes(), rng)
    meta = dict(blob.metadata or {})
    new = client.bucket(bucket).blob(name)
    new.metadata = meta
    new.upload_from_string(raw)
    return bit


def test_every_single_bit_flip_of_a_manifest_is_detected(tmp_path: Path) -> None:
    from tests.fixtures.gcs import make_shard

    src, m, _ = make_shard(tmp_path, job_id=JOB, step=5)
    raw = m.to_json()
    assert unseal(raw, "x") == m.model_dump_json().encode()
    tier = PosixTier(tmp_path / "pvc")
    tier.put_shard(JOB, 5, 0, src, m)
    path = tier.manifest_path(JOB, 5, 0)
    for bit in range(len(raw) * 8):
        b = bytearray(raw)
        b[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(b))
        with pytest.raises(ShardCorrupt):
            tier.get_manifest(JOB, 5, 0)
    # A well-formed manifest of an older format (no seal) is skipped, never quarantined.
    old = m.model_dump(mode="json") | {"format_version": 1}
    import json

    path.write_bytes(json.dumps(old).encode())
    with pytest.raises(ShardUnavailable, match="format version 1") as info:
        tier.get_manifest(JOB, 5, 0)
    assert not isinstance(info.value, ShardCorrupt)
    path.write_bytes(seal(b'{"format": "strata-shard"}'))
    with pytest.raises(ShardCorrupt, match="malformed manifest"):
        tier.get_manifest(JOB, 5, 0)
    assert isinstance(Manifest.from_json(raw, "x"), Manifest)


def test_the_same_bytes_are_parsed_once_and_a_flip_still_fails(tmp_path: Path) -> None:
    """Issue 14: a restore reads one manifest up to ten times; the same stored bytes parse to
    the same object (kept by their exact bytes), and bytes that differ in one bit are parsed,
    and refused, as before."""
    from tests.fixtures.gcs import make_shard

    _src, m, _ = make_shard(tmp_path, job_id=JOB, step=6)
    raw = m.to_json()
    first = Manifest.from_json(raw, "x")
    assert Manifest.from_json(bytes(bytearray(raw)), "y") is first  # equal bytes, another object
    assert first == m
    rng = random.Random(6)
    for _ in range(64):
        bad, bit = flip_bit(raw, rng)
        with pytest.raises(ManifestError):
            Manifest.from_json(bad, f"bit {bit}")
    # Kept manifests are bounded: after PARSED_KEEP others, the first is parsed anew.
    for step in range(PARSED_KEEP):
        Manifest.from_json(m.model_copy(update={"step": 100 + step}).to_json(), "other")
    again = Manifest.from_json(raw, "x")
    assert again == first and again is not first


def test_an_intact_manifest_of_a_newer_strata_is_skipped_never_quarantined(tmp_path: Path) -> None:
    """Rolling upgrade: a newer trainer wrote an optional field this sidecar does not know. The
    seal verifies, so the copy is intact: it is skipped (ShardUnavailable, not ShardCorrupt) and
    its files stay where they are for the Strata that reads them."""
    import json

    from tests.fixtures.gcs import make_shard

    src, m, _ = make_shard(tmp_path, job_id=JOB, step=5)
    tier = PosixTier(tmp_path / "pvc")
    tier.put_shard(JOB, 5, 0, src, m)
    path = tier.manifest_path(JOB, 5, 0)
    body = m.model_dump(mode="json")
    body["storages"] = [dict(e, a_field_of_a_newer_strata=True) for e in body["storages"]]
    body["another_new_field"] = {"x": 1}
    path.write_bytes(seal(json.dumps(body).encode()))
    with pytest.raises(ShardUnavailable, match="another Strata version") as info:
        tier.get_manifest(JOB, 5, 0)
    assert not isinstance(info.value, ShardCorrupt)
    assert path.exists() and tier.data_path(JOB, 5, 0).exists()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_failure3_flipped_manifests_fall_back_tier_by_tier_then_to_an_older_step(
    shm_dir: Path, tmp_path: Path, gcs_emulator: GcsEmulator, gcs_bucket: str, seed: int
) -> None:
    """Failure 3: a random bit of the manifest flipped in RAM -> PVC serves; in RAM and on the
    PVC -> GCS serves; on all three -> the older step serves. Never an exception, never a wrong
    value; each bad copy quarantined."""
    rng = random.Random(seed)
    gcs_cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt")
    config = StrataConfig(
        job_id=JOB,
        ram={"path": str(shm_dir / "ram"), "keep": 2},
        pvc={"path": str(tmp_path / "pvc")},
        gcs=gcs_cfg,
    )
    client = gcs_emulator.client()
    t = Trainer(seed=seed)
    pvc = PosixTier(tmp_path / "pvc")
    with (
        Checkpointer(config, rank=0, world_size=1) as c,
        GcsTier(gcs_cfg, client=client) as gcs,
    ):
        saved = {}
        for step in (30, 40):
            t.train(step)
            t.opt.param_groups[0]["lr"] = 1e-3 * step
            assert c.save(step, t.state)
            saved[step] = (t.weights(), t.opt.param_groups[0]["lr"])
            promote(c, step, pvc)
            promote(c, step, gcs)

        def flip_posix(path: Path) -> None:
            raw, _ = flip_bit(path.read_bytes(), rng)
            path.write_bytes(raw)

        gcs_name = gcs.object_name(layout.manifest_key(JOB, 40, 0))

        def check(step: int, tier: str, res_skipped: list[str]) -> None:
            w, lr = saved[step]
            assert same_weights(t.weights(), w)
            assert t.opt.param_groups[0]["lr"] == lr
            assert t.state["step"] == step

        flip_posix(c.ram.manifest_path(JOB, 40, 0))
        t.train(1)
        res = c.restore(t.state)
        assert (res.step, res.tiers) == (40, {0: "pvc"}), res.skipped
        check(40, "pvc", res.skipped)
        assert any(n.startswith("ram:") and "quarantined" in n for n in res.skipped)

        assert 40 not in c.ram.complete_steps(JOB)  # the PVC copy was loaded in place
        flip_posix(pvc.manifest_path(JOB, 40, 0))
        t.train(2)
        res = c.restore(t.state)
        assert (res.step, res.tiers) == (40, {0: "gcs"}), res.skipped
        check(40, "gcs", res.skipped)

        flip_posix(c.ram.manifest_path(JOB, 40, 0))  # the copy staged from GCS
        flip_gcs_object(client, gcs_bucket, gcs_name, rng)
        t.train(3)
        res = c.restore(t.state)
        assert res.step == 30, res.skipped
        check(30, res.tiers[0], res.skipped)
