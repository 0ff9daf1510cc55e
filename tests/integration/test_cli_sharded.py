"""``strata inspect`` and ``strata export`` on a sharded multi-rank step written by a real gloo
job (2 processes, DTensors on a 1-D CPU mesh, a DDP-style replicated tensor): the export is the
global state, sharded tensors reassembled, compared tensor by tensor with what was sharded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import strata.format.manifest as manifest_module
from strata.cli import main
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not hasattr(manifest_module, "ShardedEntry"),
        reason="sharded state (issue 13) is not in this tree yet",
    ),
]

JOB = "ns.sharded-export"
STEP = 30
WORLD = 2

WORKER = r"""
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from strata.client import Checkpointer

ram_root, job, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
g = torch.Generator().manual_seed(step)
full = {"w": torch.randn(10, 6, generator=g), "v": torch.randn(9, generator=g),
        "e": torch.arange(15, dtype=torch.int64).reshape(5, 3),
        "ddp": torch.randn(33, generator=g)}
state = {
    "model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
              "v": distribute_tensor(full["v"], mesh, [Replicate()]),
              "e": distribute_tensor(full["e"], mesh, [Shard(1)])},
    "ddp": full["ddp"],
    "per_rank": torch.full((4,), float(rank)),
    "step": step,
}
with Checkpointer(job_id=job, ram_dir=os.path.join(ram_root, f"node-{rank}"),
                  allow_fresh_start=True) as c:
    assert c.save(step, state, replicated={"ddp"}), c.last_error
    c.wait()
dist.barrier()
dist.destroy_process_group()
"""


def _expected() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(STEP)
    return {
        "model.w": torch.randn(10, 6, generator=g),
        "model.v": torch.randn(9, generator=g),
        "model.e": torch.arange(15, dtype=torch.int64).reshape(5, 3),
        "ddp": torch.randn(33, generator=g),
        "rank0/per_rank": torch.full((4,), 0.0),
        "rank1/per_rank": torch.full((4,), 1.0),
    }


@pytest.fixture
def sharded_pvc(tmp_path: Path, shm_dir: Path) -> Path:
    """A PVC directory holding a sharded 2-rank step, written by a real gloo job into each
    rank's RAM tier and promoted with the tiers' own put_shard (what the sidecar does)."""
    pytest.importorskip("torch.distributed.tensor")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
        }
        env.pop("STRATA_CONFIG", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(shm_dir), JOB, str(STEP)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    pvc_dir = tmp_path / "pvc"
    pvc_dir.mkdir()
    pvc = PosixTier(pvc_dir, "pvc")
    for rank in range(WORLD):
        ram = RamTier(shm_dir / f"node-{rank}")
        m = ram.get_manifest(JOB, STEP, rank)
        pvc.put_shard(JOB, STEP, rank, ram.data_path(JOB, STEP, rank), m)
    return pvc_dir


def test_inspect_shows_global_shapes_and_export_reassembles_sharded_tensors(
    sharded_pvc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    assert main(["inspect", str(sharded_pvc), "--job", JOB, "--step", str(STEP), "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    w = [r for r in rows if r["key"] == "model.w"]
    assert {r["rank"] for r in w} == {0, 1}
    assert all(r["type"] == "sharded" and r["shape"] == [10, 6] for r in w)
    assert sorted(r["chunk"]["offsets"] for r in w) == [[0, 0], [5, 0]]
    ddp = [r for r in rows if r["key"] == "ddp"]
    assert sum(1 for r in ddp if r["bytes"]) == 1  # written once, by its owner

    dst = tmp_path / "st"
    argv = ["export", str(sharded_pvc), "--job", JOB, "--step", str(STEP), "-o", "json"]
    assert main([*argv, "--to", "safetensors", str(dst)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == WORLD
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    expected = _expected()
    assert set(index["weight_map"]) == set(expected)
    for key, want in expected.items():
        with safe_open(str(dst / index["weight_map"][key]), framework="pt") as f:
            got = f.get_tensor(key)
        assert got.dtype == want.dtype and torch.equal(got, want), key

    dcp_dir = tmp_path / "dcp"
    assert main([*argv, "--to", "dcp", str(dcp_dir)]) == 0
    capsys.readouterr()
    from torch.distributed.checkpoint.state_dict_loader import load

    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    target["step"] = None  # type: ignore[assignment]
    with pytest.warns(UserWarning):
        load(target, checkpoint_id=str(dcp_dir))
    for key, want in expected.items():
        assert torch.equal(target[key], want), key
    assert target["step"] == STEP
