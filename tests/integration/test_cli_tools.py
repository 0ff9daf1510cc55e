"""``strata list | plan | verify | inspect | export`` against real tiers: a tmpfs RAM tier
(/dev/shm), a PVC directory, and fake-gcs-server through the real client; real checkpoints
committed by the tiers' own ``put_shard`` (tests/fixtures/checkpoints.py), corrupted for real.

The CLI runs in-process through :func:`strata.cli.main` (the console script's entry point);
one test runs the installed-style ``python -m strata.cli`` to check the exit code end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.cli import main
from strata.cli.export import flatten
from strata.format import layout
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from tests.fixtures.checkpoints import flip_byte, write_step
from tests.fixtures.gcs import GcsEmulator

pytestmark = pytest.mark.integration

JOB = "team-a.llm"


@dataclass
class Tiers:
    ram: RamTier
    pvc: PosixTier
    gcs: GcsTier
    gcs_url: str
    client: Any

    @property
    def specs(self) -> list[str]:
        return [str(self.ram.root), str(self.pvc.root), self.gcs_url]


@pytest.fixture
def tiers(
    shm_dir: Path,
    tmp_path: Path,
    gcs_emulator: GcsEmulator,
    gcs_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Tiers]:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    pvc_dir = tmp_path / "pvc"
    pvc_dir.mkdir()
    gcs = GcsTier(gcs_emulator.tier_config(gcs_bucket, prefix="ckpt"), writer_id="test")
    try:
        yield Tiers(
            RamTier(shm_dir),
            PosixTier(pvc_dir, "pvc"),
            gcs,
            f"gs://{gcs_bucket}/ckpt",
            gcs_emulator.client(),
        )
    finally:
        gcs.close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """Run ``strata argv... -o json``; (exit code, parsed stdout or None, stderr)."""
    code = main([*argv, "-o", "json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else None), out.err


# -- list -----------------------------------------------------------------------------------------


def test_list_shows_every_step_per_tier_with_completeness_world_size_and_size(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    write_step([tiers.ram, tiers.pvc, tiers.gcs], JOB, 100, 2)
    write_step([tiers.ram], JOB, 110, 2, ranks=[0])  # rank 1 never finished
    write_step([tiers.gcs], "team-b.other", 5, 1)

    code, rows, _ = run(capsys, "list", *tiers.specs)
    assert code == 0
    got = {(r["tier"], r["job"], r["step"]): r for r in rows}
    assert set(got) == {
        ("ram", JOB, 100),
        ("ram", JOB, 110),
        ("pvc", JOB, 100),
        ("gcs", JOB, 100),
        ("gcs", "team-b.other", 5),
    }
    full = got[("gcs", JOB, 100)]
    assert full["complete"] is True and full["world_size"] == 2
    assert full["committed_ranks"] == [0, 1] and full["location"] == tiers.gcs_url
    assert full["bytes"] == sum(tiers.pvc.get_manifest(JOB, 100, r).data_nbytes for r in (0, 1))
    half = got[("ram", JOB, 110)]
    assert half["complete"] is False and half["committed_ranks"] == [0]
    # created: RFC 3339 in UTC (what log pipelines and `date -d` read), the manifest's time.
    created = datetime.fromisoformat(full["created"])
    assert isinstance(full["created"], str) and full["created"].endswith("+00:00")
    oldest = min(tiers.gcs.get_manifest(JOB, 100, r).created.timestamp() for r in (0, 1))
    assert abs(created.timestamp() - oldest) < 0.001  # milliseconds kept

    code, rows, _ = run(capsys, "list", *tiers.specs, "--job", "team-b.other")
    assert code == 0 and [(r["tier"], r["step"]) for r in rows] == [("gcs", 5)]


def test_list_table_for_people_and_clear_errors(
    tiers: Tiers, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_step([tiers.pvc], JOB, 7, 1)
    assert main(["list", str(tiers.pvc.root)]) == 0
    out = capsys.readouterr().out
    assert JOB in out and "yes" in out and "1/1" in out

    assert main(["list", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["list", str(tiers.pvc.root), "--job", "missing"]) == 3
    assert "missing" in capsys.readouterr().err


# -- plan -----------------------------------------------------------------------------------------


def test_plan_picks_the_newest_step_every_rank_can_read_and_says_why_nearer_tiers_were_skipped(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    write_step([tiers.pvc, tiers.gcs], JOB, 100, 2)
    write_step([tiers.ram], JOB, 100, 2, ranks=[0])  # rank 1's node lost its RAM
    write_step([tiers.ram, tiers.pvc], JOB, 200, 2, ranks=[0])  # rank 1 never saved 200

    code, plan, _ = run(capsys, "plan", *tiers.specs, "--job", JOB)
    assert code == 0
    assert plan["step"] == 100 and plan["world_size"] == 2
    r0, r1 = plan["ranks"]
    assert (r0["tier"], r1["tier"]) == ("ram", "pvc")
    assert r1["location"] == str(tiers.pvc.root)
    assert any(s.startswith("ram:") and "rank 1" in s for s in r1["skipped"]), r1
    assert any("step 200" in s and "[1]" in s for s in plan["newer_steps_skipped"])


def test_plan_verify_falls_past_a_corrupt_copy_like_a_restore_and_never_quarantines(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    write_step([tiers.ram, tiers.pvc, tiers.gcs], JOB, 300, 2)
    flip_byte(tiers.ram.data_path(JOB, 300, 1))
    flip_byte(tiers.pvc.data_path(JOB, 300, 1))

    code, plan, _ = run(capsys, "plan", *tiers.specs, "--job", JOB)
    assert code == 0 and [r["tier"] for r in plan["ranks"]] == ["ram", "ram"]  # listing only

    code, plan, _ = run(capsys, "plan", *tiers.specs, "--job", JOB, "--verify")
    assert code == 0 and plan["step"] == 300
    r1 = plan["ranks"][1]
    assert r1["tier"] == "gcs"
    assert [s.split(":")[0] for s in r1["skipped"]] == ["ram", "pvc"]
    assert all("CRC32C mismatch" in s for s in r1["skipped"])
    # Read-only: both bad copies are still committed where they were.
    assert tiers.ram.get_manifest(JOB, 300, 1) and tiers.pvc.get_manifest(JOB, 300, 1)


def test_plan_with_nothing_restorable_exits_3(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    write_step([tiers.pvc], JOB, 10, 2, ranks=[1])
    code, plan, _ = run(capsys, "plan", str(tiers.pvc.root), "--job", JOB)
    assert code == 3 and plan["step"] is None
    assert any("step 10" in s and "[0]" in s for s in plan["newer_steps_skipped"])
    code, plan, _ = run(capsys, "plan", str(tiers.pvc.root), "--job", JOB, "--world-size", "4")
    assert code == 3 and any("world size 2" in n for n in plan["notes"])


# -- verify ---------------------------------------------------------------------------------------


def test_verify_all_intact_exits_0_with_a_summary(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    write_step([tiers.ram, tiers.pvc, tiers.gcs], JOB, 100, 3)
    code, doc, _ = run(capsys, "verify", *tiers.specs, "--job", JOB)
    assert code == 0
    assert [r["status"] for r in doc["copies"]] == ["ok"] * 9
    s = doc["summary"]
    assert s["copies"] == 9 and s["bad"] == 0 and s["steps"] == 3
    assert s["bytes_checked"] == 3 * sum(
        tiers.pvc.get_manifest(JOB, 100, r).data_nbytes for r in range(3)
    )


def test_verify_finds_every_kind_of_bad_copy_in_every_tier_and_exits_1(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    write_step([tiers.ram, tiers.pvc, tiers.gcs], JOB, 100, 2)
    write_step([tiers.pvc], JOB, 200, 2, ranks=[0])
    flip_byte(tiers.ram.data_path(JOB, 100, 0))  # bit rot in RAM
    with open(tiers.pvc.data_path(JOB, 100, 1), "r+b") as f:  # truncated on the PVC
        f.truncate(50)
    # GCS: the data object replaced by other bytes of the same length.
    blob = tiers.client.bucket(tiers.gcs.bucket_name).blob(
        tiers.gcs.object_name(layout.data_key(JOB, 100, 1))
    )
    good = blob.download_as_bytes()
    blob.upload_from_string(bytes(b ^ 0x5A for b in good))
    # A data file without a manifest (an interrupted save): not a bad copy.
    partial = tiers.pvc.data_path(JOB, 200, 1)
    partial.write_bytes(b"x" * 10)

    code, doc, _ = run(capsys, "verify", *tiers.specs, "--job", JOB)
    assert code == 1
    status = {(r["tier"], r["step"], r["rank"]): r["status"] for r in doc["copies"]}
    assert status == {
        ("ram", 100, 0): "corrupt",
        ("ram", 100, 1): "ok",
        ("pvc", 100, 0): "ok",
        ("pvc", 100, 1): "corrupt",
        ("pvc", 200, 0): "ok",
        ("pvc", 200, 1): "partial",
        ("gcs", 100, 0): "ok",
        ("gcs", 100, 1): "corrupt",
    }
    details = {(r["tier"], r["rank"]): r["detail"] for r in doc["copies"] if r["step"] == 100}
    assert "CRC32C mismatch" in details[("ram", 0)]
    assert "truncated" in details[("pvc", 1)] or "shorter" in details[("pvc", 1)]
    assert doc["summary"]["bad"] == 3
    # Only step 200 in the PVC: intact, exit 0. Nothing quarantined by verify.
    code, doc, _ = run(capsys, "verify", str(tiers.pvc.root), "--job", JOB, "--step", "200")
    assert code == 0 and doc["summary"]["by_status"] == {"ok": 1, "partial": 1}
    assert tiers.ram.get_manifest(JOB, 100, 0)
    code, _, err = run(capsys, "verify", str(tiers.pvc.root), "--job", JOB, "--step", "999")
    assert code == 3 and "nothing found" in err


def test_verify_exit_code_from_the_console_script(tiers: Tiers) -> None:
    write_step([tiers.pvc], JOB, 1, 1)
    flip_byte(tiers.pvc.data_path(JOB, 1, 0))
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli", "verify", str(tiers.pvc.root), "--job", JOB],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "corrupt" in proc.stdout and "1 bad copies" in proc.stdout


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_lists_keys_dtypes_shapes_and_sizes_from_the_manifest(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    states = write_step([tiers.gcs], JOB, 100, 2)
    code, rows, _ = run(capsys, "inspect", tiers.gcs_url, "--job", JOB, "--step", "100")
    assert code == 0
    for rank in (0, 1):
        expected = flatten(states[rank])
        got = {r["key"]: r for r in rows if r["rank"] == rank}
        assert set(got) == set(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert got[key]["type"] == "tensor"
                assert got[key]["dtype"] == str(value.dtype).removeprefix("torch.")
                assert got[key]["shape"] == list(value.shape)
                assert got[key]["bytes"] == value.numel() * value.element_size()
            else:
                assert got[key]["value"] == value
    code, rows, _ = run(
        capsys, "inspect", tiers.gcs_url, "--job", JOB, "--step", "100", "--rank", "1"
    )
    assert code == 0 and {r["rank"] for r in rows} == {1}
    code, _, err = run(capsys, "inspect", tiers.gcs_url, "--job", JOB, "--step", "5")
    assert code == 3 and "strata list" in err


# -- export ---------------------------------------------------------------------------------------


def _expected_global(states: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Replicated keys once, rank-specific keys as rank<R>/<key> (the documented naming)."""
    flat = {r: flatten(s) for r, s in states.items()}
    out: dict[str, Any] = {}
    for key, v0 in flat[0].items():
        vs = [flat[r][key] for r in sorted(flat)]
        same = all((torch.equal(v, v0) if isinstance(v0, torch.Tensor) else v == v0) for v in vs)
        if same:
            out[key] = v0
        else:
            out.update({f"rank{r}/{key}": flat[r][key] for r in sorted(flat)})
    return out


def test_export_safetensors_round_trips_tensor_by_tensor_with_an_hf_index(
    tiers: Tiers, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from safetensors import safe_open

    states = write_step([tiers.ram, tiers.gcs], JOB, 100, 3)
    flip_byte(tiers.ram.data_path(JOB, 100, 2))  # rank 2 must come from GCS
    dst = tmp_path / "st"
    code, report, _ = run(
        capsys,
        "export",
        str(tiers.ram.root),
        tiers.gcs_url,
        "--job",
        JOB,
        "--step",
        "100",
        "--to",
        "safetensors",
        str(dst),
        "--max-shard-size",
        "20000",
    )
    assert code == 0
    assert report["sources"] == {
        "0": str(tiers.ram.root),
        "1": str(tiers.ram.root),
        "2": tiers.gcs_url,
    }
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    expected = _expected_global(states)
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    assert set(index["weight_map"]) == set(tensors)
    assert "rank0/shard" in tensors and "model.embed.weight" in tensors
    total = 0
    for key, want in tensors.items():
        with safe_open(str(dst / index["weight_map"][key]), framework="pt") as f:
            got = f.get_tensor(key)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
        total += want.numel() * want.element_size()
    assert index["metadata"]["total_size"] == total
    others = json.loads((dst / "non_tensor_state.json").read_text())
    assert others["step"] == 100 and others["optim.param_groups.0.lr"] == 0.01

    code, _, err = run(
        capsys, "export", tiers.gcs_url, "--job", JOB, "--step", "100", "--to", "dcp", str(dst)
    )
    assert code == 2 and "not an empty directory" in err


def test_export_dcp_loads_with_dcp_load_tensor_by_tensor(
    tiers: Tiers, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    states = write_step([tiers.pvc], JOB, 40, 2)
    dst = tmp_path / "dcp"
    code, report, _ = run(
        capsys, "export", str(tiers.pvc.root), "--job", JOB, "--step", "40", "--to", "dcp", str(dst)
    )
    assert code == 0 and report["world_size"] == 2
    expected = _expected_global(states)
    target = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
        for k, v in expected.items()
    }
    with pytest.warns(UserWarning, match="single process|uninitialized|disabled"):
        load(target, checkpoint_id=str(dst))
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            got = target[key]
            assert isinstance(got, torch.Tensor) and torch.equal(got, want), key
        else:
            assert target[key] == want, key


def test_export_safetensors_writes_tied_weights_once(
    tiers: Tiers, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An embedding tied to the output head (one storage, two names) is stored once; the index
    and the file name the alias, and safetensors' load_model re-ties it into a live model."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    def tied_state(step: int, rank: int) -> dict[str, Any]:
        torch.manual_seed(step)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
        model[1].weight = model[0].weight
        return {"model": model.state_dict(), "step": step}

    states = write_step([tiers.pvc], JOB, 50, 1, make_state=tied_state)
    weight = states[0]["model"]["0.weight"]
    dst = tmp_path / "tied"
    code, report, _ = run(
        capsys, "export", str(tiers.pvc.root), "--job", JOB, "--step", "50", "--to",
        "safetensors", str(dst),
    )  # fmt: skip
    assert code == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"model.0.weight", "model.1.bias"}
    assert report["tied"] == 1
    assert index["metadata"]["tied_weights"] == {"model.1.weight": "model.0.weight"}
    assert index["metadata"]["total_size"] == (64 * 32 + 64) * 4
    (name,) = set(index["weight_map"].values())
    assert (dst / name).stat().st_size < 64 * 32 * 4 * 2
    with safe_open(str(dst / name), framework="pt") as f:
        assert set(f.keys()) == {"model.0.weight", "model.1.bias"}
        assert f.metadata()["model.1.weight"] == "model.0.weight"
        assert torch.equal(f.get_tensor("model.0.weight"), weight)
    emb, head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)
    head.weight = emb.weight
    wrapper = torch.nn.Module()
    wrapper.model = torch.nn.Sequential(emb, head)
    missing, unexpected = load_model(wrapper, str(dst / name))
    assert not missing and not unexpected
    assert torch.equal(head.weight, weight) and head.weight is emb.weight


def test_export_without_a_verified_copy_fails_with_exit_1(
    tiers: Tiers, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_step([tiers.pvc], JOB, 5, 1)
    flip_byte(tiers.pvc.data_path(JOB, 5, 0))
    code, _, err = run(
        capsys,
        "export",
        str(tiers.pvc.root),
        "--job",
        JOB,
        "--step",
        "5",
        "--to",
        "safetensors",
        str(tmp_path / "o"),
    )
    assert code == 1 and "CRC32C mismatch" in err


def test_list_plan_verify_inspect_need_no_torch(tiers: Tiers) -> None:
    """They run in the sidecar image (no torch), e.g. in `kubectl strata verify`'s Job."""
    write_step([tiers.pvc], JOB, 1, 2)
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from strata.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    pvc = str(tiers.pvc.root)
    for argv in (
        ["list", pvc],
        ["plan", pvc, "--job", JOB, "--verify"],
        ["verify", pvc],
        ["inspect", pvc, "--job", JOB, "--step", "1"],
    ):
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, (argv, proc.stderr)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "export",
            pvc,
            "--job",
            JOB,
            "--step",
            "1",
            "--to",
            "dcp",
            str(tiers.pvc.root.parent / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "needs torch" in proc.stderr


def test_an_unreadable_tier_exits_4_naming_it(
    tiers: Tiers, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "list", "gs://strata-no-such-bucket/ckpt")
    assert code == 4 and "strata-no-such-bucket" in err and "does not exist" in err
    code, _, err = run(capsys, "verify", "gs://strata-no-such-bucket", "--job", JOB)
    assert code == 4
