"""The peer tier end to end (issue 16): real ``strata sidecar`` processes, one per "node", each
with its own RAM directory on the machine's tmpfs, and the real training client.

Three trainers save step 130 through their node's sidecar; the sidecars replicate each other's
RAM step over mutual TLS. Node 1 is lost (its sidecar SIGKILLed, its RAM wiped); the replacement
sidecar starts on an empty RAM directory and the job restarts: three trainer processes (gloo)
``restore()`` step 130 -- ranks 0 and 2 from their RAM, rank 1 from the peers, bit-identical,
with no PVC configured at all; the sidecar's report to the operator says the tier was ``peer``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.client import Checkpointer
from strata.config import StrataConfig
from strata.peers.placement import PeerSite, replica_holders
from strata.peers.store import PeerStore
from tests.fixtures.peers import job_tls, make_ca
from tests.fixtures.sidecar import ReportReceiver, SidecarProcess, free_port

pytestmark = pytest.mark.integration

JOB = "team.peers-e2e"
WORLD = 3
STEP = 130


_TRAINER = r"""
import json, sys
import torch
import torch.distributed as dist
from strata.client import Checkpointer

dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(rank)
want = {"w": torch.randn(300, 700, generator=g), "b": torch.randn(77, generator=g)}
live = {"w": torch.zeros(300, 700), "b": torch.zeros(77), "step": 0}
with Checkpointer() as c:
    res = c.restore(live)
ok = torch.equal(live["w"], want["w"]) and torch.equal(live["b"], want["b"])
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"step": res.step, "tiers": {str(k): v for k, v in res.tiers.items()}, "ok": ok}))
"""


def restart_job(configs: list[StrataConfig]) -> list[dict[str, Any]]:
    """Every rank's trainer restores (gloo on loopback), each through its node's sidecar."""
    port = free_port()
    procs = []
    for rank, c in enumerate(configs):
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        env.update(c.to_env())
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(len(configs)),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _TRAINER], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        assert p.returncode == 0, stdout
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def state_of(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(300, 700, generator=g), "b": torch.randn(77, generator=g), "step": 0}


def test_a_lost_node_restores_its_ram_step_from_peers_through_the_sidecar(
    shm_dir: Path,
    tmp_path: Path,
    sidecar_proc: Callable[..., SidecarProcess],
    report_receiver: ReportReceiver,
) -> None:
    ca = make_ca()
    ids = [f"worker-{i}" for i in range(WORLD)]
    ports = [free_port() for _ in ids]
    peers = [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in zip(ids, ports, strict=True)]
    token = tmp_path / "token"
    token.write_text("t\n")

    def config(i: int) -> StrataConfig:
        tls, _ = job_tls(tmp_path / f"tls-{i}-{time.monotonic_ns()}", JOB, ca)
        return StrataConfig.parse(
            {
                "job_id": JOB,
                "ram": {"path": str(shm_dir / f"node{i}"), "keep": 1},
                "metrics_port": free_port(),
                "metrics_host": "127.0.0.1",
                "policy": "peers",
                "namespace": "team",
                "pod_name": ids[i],
                "node_name": f"node-{i}",
                "report": {
                    "endpoint": report_receiver.url,
                    "token_path": str(token),
                    "ca_path": str(report_receiver.ca_path),
                },
                "peers": {
                    "mode": "replicate",
                    "self_id": ids[i],
                    "peers": peers,
                    "listen_host": "127.0.0.1",
                    "port": ports[i],
                    "tls": tls.model_dump(),
                    "poll_seconds": 0.2,
                },
            }
        )

    configs = [config(i) for i in range(WORLD)]
    sidecars = [sidecar_proc(c) for c in configs]
    for i, c in enumerate(configs):
        with Checkpointer(c, rank=i, world_size=WORLD) as trainer:
            assert trainer.save(STEP, state_of(i))
            trainer.wait()

    sites = [PeerSite(p) for p in ids]
    holder = {ids[i]: replica_holders(sites, ids[i], 1)[0] for i in range(WORLD)}
    stores = {p: PeerStore(shm_dir / f"node{i}", JOB) for i, p in enumerate(ids)}
    deadline = time.monotonic() + 120
    while not all(STEP in stores[holder[p]].replicas().get(p, {}) for p in ids):
        assert time.monotonic() < deadline, [s.logs()[-2000:] for s in sidecars]
        time.sleep(0.1)

    # Node 1 is lost: its sidecar dies with its RAM; a replacement starts on an empty RAM.
    sidecars[1].kill()
    shutil.rmtree(shm_dir / "node1")
    replacement = sidecar_proc(config(1))
    configs[1] = replacement.config
    results = restart_job(configs)
    assert [r["step"] for r in results] == [STEP] * WORLD  # no PVC is even configured
    assert all(r["ok"] for r in results)  # bit-identical tensors on every rank
    assert results[0]["tiers"] == {"0": "ram", "1": "peer", "2": "ram"}

    reported = report_receiver.wait_for(
        lambda r: (
            r["json"]["pod_name"] == "worker-1"
            and any(x.get("tier") == "peer" for x in r["json"].get("restores", []))
        )
    )
    (restore,) = [x for x in reported["json"]["restores"] if x.get("tier") == "peer"]
    assert restore["step"] == STEP and restore["outcome"] == "restored"
    assert 'strata_stage_total{outcome="staged",tier="peer"} 1.0' in replacement.scrape()
