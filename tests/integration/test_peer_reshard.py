"""A resized job reshards its newest step from the peer tier, through its sidecars (issue
"Restore anywhere"): real ``strata sidecar`` processes, one per "node", each with its own RAM
directory on the machine's tmpfs, replicating each other's RAM step over mutual TLS, and real
gloo trainer processes saving and restoring a DTensor state.

Four ranks (one per node) save step 130; each node's step is copied to one other node. Nodes 0
and 2 are lost (sidecar SIGKILLed, RAM wiped) and come back empty; no PVC or GCS is configured,
so the only copy of step 130 is on the peers (nodes 1 and 3: their own RAM and the replicas of
nodes 0 and 2). The job restarts on the replacement nodes at 2 ranks, then at 8 (four per node),
and each time, by default, reshards step 130 from ``peer``: the trainer reaches the peers through its sidecar's local API
(:class:`strata.client.peer_source.PeerSource`), reading only the ranges it needs.
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

from strata.config import StrataConfig
from strata.peers.placement import PeerSite, replica_holders
from strata.peers.store import PeerStore
from tests.fixtures.peers import job_tls, make_ca
from tests.fixtures.sidecar import SidecarProcess, free_port

pytestmark = pytest.mark.integration

JOB = "team.peer-reshard"
NODES = 4
STEP = 130
LOST = (0, 2)
"""Their replicas are on nodes 1 and 3 (ring placement, one copy), which survive."""

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from strata.client import Checkpointer

mode, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
pl = {"a": [Shard(0)], "b": [Shard(0)], "c": [Replicate()]}

def global_tensors(s):
    g = torch.Generator().manual_seed(1000 + s)
    return {"a": torch.randn(2048, 512, generator=g),
            "b": torch.randn(1000, 300, generator=g).to(torch.bfloat16),
            "c": torch.randn(33, generator=g)}

def state_for(s, zero=False):
    gt = global_tensors(s)
    if zero:
        gt = {k: torch.zeros_like(v) for k, v in gt.items()}
    return {"model": {k: distribute_tensor(gt[k], mesh, pl[k]) for k in pl}, "step": s}

result = {"rank": rank}
with Checkpointer() as c:
    if mode == "save":
        assert c.save(step, state_for(step)), c.last_error
        c.wait()
    else:
        live = state_for(0, zero=True)
        res = c.restore(live)
        result.update(step=res.step, resharded=res.resharded, skipped=res.skipped,
                      saved_world_size=res.saved_world_size, nbytes=res.nbytes,
                      tiers={str(k): v for k, v in res.tiers.items()})
        if res.step is not None:
            gt = global_tensors(res.step)
            result["equal"] = {
                k: bool(torch.equal(live["model"][k].full_tensor(), gt[k])) for k in pl
            }
        result["sources"] = [t.name for t in c.tiers.get()]
        peer = [t for t in c.tiers.get() if t.name == "peer"]
        result["fetched"] = peer[0].nbytes_fetched if peer else None
        # what this rank holds now: its slices of the sharded tensors, all of the replicated one
        result["needed"] = sum(
            t.to_local().numel() * t.to_local().element_size() for t in live["model"].values()
        )
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"{mode}-rank-{rank}.json"), "w") as f:
    json.dump(result, f)
"""


def run_job(mode: str, configs: list[StrataConfig], out: Path) -> list[dict[str, Any]]:
    """Rank r of ``len(configs)`` runs the worker with ``configs[r]`` (its node's sidecar)."""
    out.mkdir(parents=True, exist_ok=True)
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
            NO_PROXY="127.0.0.1,localhost",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, mode, str(STEP), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=300)
            logs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    failed = [
        (r, lg[-3000:]) for r, (p, lg) in enumerate(zip(procs, logs, strict=True)) if p.returncode
    ]
    assert not failed, failed
    return [json.loads((out / f"{mode}-rank-{r}.json").read_text()) for r in range(len(configs))]


def test_a_resized_job_reshards_from_the_peers_through_its_sidecars_4_to_2_and_8(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess]
) -> None:
    ca = make_ca()
    ids = [f"worker-{i}" for i in range(NODES)]
    ports = [free_port() for _ in ids]
    peers = [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in zip(ids, ports, strict=True)]

    def config(i: int) -> StrataConfig:
        tls, _ = job_tls(tmp_path / f"tls-{i}-{time.monotonic_ns()}", JOB, ca)
        return StrataConfig.parse(
            {
                "job_id": JOB,
                "ram": {"path": str(shm_dir / f"node{i}"), "keep": 1},
                "metrics_port": free_port(),
                "metrics_host": "127.0.0.1",
                "namespace": "team",
                "pod_name": ids[i],
                "node_name": f"node-{i}",
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

    configs = [config(i) for i in range(NODES)]
    sidecars = [sidecar_proc(c) for c in configs]
    run_job("save", configs, tmp_path / "save")

    sites = [PeerSite(p) for p in ids]
    holder = {p: replica_holders(sites, p, 1)[0] for p in ids}
    assert {holder[ids[i]] for i in LOST} == {ids[1], ids[3]}  # the survivors hold them
    stores = {p: PeerStore(shm_dir / f"node{i}", JOB) for i, p in enumerate(ids)}
    deadline = time.monotonic() + 120
    while not all(STEP in stores[holder[p]].replicas().get(p, {}) for p in ids):
        assert time.monotonic() < deadline, [s.logs()[-2000:] for s in sidecars]
        time.sleep(0.1)

    # Nodes 0 and 2 are lost with their RAM; replacements start on empty RAM directories.
    replacements = []
    for i in LOST:
        sidecars[i].kill()
        shutil.rmtree(shm_dir / f"node{i}")
        replacements.append(sidecar_proc(config(i)).config)

    got = run_job("restore", replacements, tmp_path / "restore")
    assert_resharded_from_peer(got)
    for r in got:
        # only what it needs crossed the local API: its slices, rounded to checksummed pieces
        assert r["fetched"] <= 1.1 * r["needed"], r
    print("4 -> 2 bytes fetched over the local API, needed, ratio:", ratios(got))

    # The same step at 8 ranks: four ranks on each replacement node, through its sidecar.
    got = run_job("restore", [c for c in replacements for _ in range(4)], tmp_path / "eight")
    assert_resharded_from_peer(got)
    print("4 -> 8 bytes fetched over the local API, needed, ratio:", ratios(got))


def assert_resharded_from_peer(got: list[dict[str, Any]]) -> None:
    for r in got:
        assert r["step"] == STEP and r["resharded"] is True and r["saved_world_size"] == NODES, r
        assert all(r["equal"].values()), r  # bytes equal: every tensor as saved
        assert r["tiers"] == {str(r["rank"]): "reshard"}
        note = f"step {STEP} resharded from world size {NODES} to {len(got)} (read from peer)"
        assert note in r["skipped"], r["skipped"]
        assert r["sources"] == ["ram", "peer"]
        assert r["fetched"] >= r["needed"], r  # every byte it holds came over the local API
        # ... and no more than the reader asked for (the rest is its rounding to verified pieces)
        assert r["fetched"] == r["nbytes"], r


def ratios(got: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    return [(r["fetched"], r["needed"], round(r["fetched"] / r["needed"], 4)) for r in got]


def test_the_peer_source_is_absent_without_peers_and_falls_back_when_peers_fail(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess]
) -> None:
    """A sidecar without a peer tier gives no peer source (not an error); with peers that do
    not serve a shard (the only peer is down), every read is ShardUnavailable with a clear
    message and a resharding reader takes the shard from the next source (the PVC); a sidecar
    gone mid-restore is ShardUnavailable too."""
    from strata.client.peer_source import PeerSource, peer_source
    from strata.client.sharded import ShardReader
    from strata.client.sidecar_client import SidecarClient
    from strata.errors import ProtocolError, ShardUnavailable
    from strata.tiers.posix import PosixTier
    from strata.tiers.ram import RamTier
    from tests.fixtures.sidecar import write_ram_shard

    ca = make_ca()
    ports = [free_port(), free_port()]  # nothing listens on the second: a lost peer
    peers = [{"id": f"worker-{i}", "address": f"127.0.0.1:{p}"} for i, p in enumerate(ports)]
    tls, _ = job_tls(tmp_path / "tls", JOB, ca)
    base = {
        "job_id": JOB,
        "ram": {"path": str(shm_dir / "node"), "keep": 1},
        "metrics_port": free_port(),
        "metrics_host": "127.0.0.1",
    }
    with_peers = StrataConfig.parse(
        {
            **base,
            "peers": {
                "mode": "replicate",
                "self_id": "worker-0",
                "peers": peers,
                "listen_host": "127.0.0.1",
                "port": ports[0],
                "tls": tls.model_dump(),
                "poll_seconds": 0.2,
            },
        }
    )

    plain = sidecar_proc(StrataConfig.parse(base))
    client = SidecarClient(plain.config.socket)
    assert peer_source(client, with_peers) is None  # the sidecar has no peer tier
    with pytest.raises(ShardUnavailable, match="has no peer tier"):
        client.peer_steps(JOB)
    plain.kill()

    sidecar = sidecar_proc(with_peers.model_copy(update={"metrics_port": free_port()}))
    client = SidecarClient(sidecar.config.socket)
    source = peer_source(client, with_peers)
    assert isinstance(source, PeerSource)
    assert source.list_steps(JOB) == {}
    assert any("worker-1" in n for n in source.notes), source.notes  # unreachable, said so
    with pytest.raises(ShardUnavailable, match="rank 0 of step 7"):
        source.get_manifest(JOB, 7, 0)
    with pytest.raises(ShardUnavailable, match="rank 0 of step 7"):
        source.read_range(JOB, 7, 0, 0, 100)
    with pytest.raises(ProtocolError, match="ask in pieces"):
        client.peer_range(JOB, 7, 0, 0, source.max_range + 1)

    # the reader falls back to the next source: the PVC's copy of step 7
    data = os.urandom(300_000)
    m = write_ram_shard(RamTier(tmp_path / "scratch"), JOB, 7, 0, data, world_size=1)
    src = tmp_path / "shard"
    src.write_bytes(data)
    pvc = PosixTier(tmp_path / "pvc", "pvc")
    pvc.put_shard(JOB, 7, 0, src, m)
    reader = ShardReader([source, pvc], JOB, 7)
    assert bytes(reader.read(0, 1000, 5000)) == data[1000:6000]
    assert reader.served == ["pvc"] and source.nbytes_fetched == 0
    reader.close()

    sidecar.kill()  # gone mid-restore: this source is unavailable, the next one serves
    with pytest.raises(ShardUnavailable, match="the next source serves it"):
        source.get_manifest(JOB, 7, 0)


def _one_node_with_a_lost_peer(shm_dir: Path, tmp_path: Path) -> StrataConfig:
    """Node 0's config: peers worker-0 (itself) and worker-1, on whose port nothing listens."""
    ca = make_ca()
    ports = [free_port(), free_port()]
    tls, _ = job_tls(tmp_path / "tls", JOB, ca)
    return StrataConfig.parse(
        {
            "job_id": JOB,
            "ram": {"path": str(shm_dir / "node0"), "keep": 1},
            "metrics_port": free_port(),
            "metrics_host": "127.0.0.1",
            "peers": {
                "mode": "replicate",
                "self_id": "worker-0",
                "peers": [
                    {"id": f"worker-{i}", "address": f"127.0.0.1:{p}"} for i, p in enumerate(ports)
                ],
                "listen_host": "127.0.0.1",
                "port": ports[0],
                "tls": tls.model_dump(),
                "poll_seconds": 0.2,
            },
        }
    )


def test_the_peers_notes_reach_the_resharding_restore(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess]
) -> None:
    """Two ranks on one node save step 130; the job restarts at one rank and reshards it from
    the node's RAM. The node's sidecar could not reach its peer worker-1 when it listed the
    peers for the restore: the restore says so in ``skipped``, next to the reshard note."""
    config = _one_node_with_a_lost_peer(shm_dir, tmp_path)
    sidecar_proc(config)
    run_job("save", [config, config], tmp_path / "save")
    (got,) = run_job("restore", [config], tmp_path / "restore")
    assert got["step"] == STEP and got["resharded"] is True and all(got["equal"].values()), got
    assert f"step {STEP} resharded from world size 2 to 1 (read from ram)" in got["skipped"], got
    unreachable = [n for n in got["skipped"] if n.startswith("peer") and "worker-1" in n]
    assert unreachable, got["skipped"]  # the sidecar's note about its unreachable peer


def test_a_failed_probe_of_the_sidecar_is_a_note_of_the_restore(
    shm_dir: Path, tmp_path: Path
) -> None:
    """A sidecar that does not answer the peer-tier probe: no peer source, and the restore's
    notes (the tiers' notes, the first of ``RestoreResult.skipped``) say the peers were not
    searched and why."""
    from functools import partial

    from strata.client.peer_source import peer_source
    from strata.client.restore_load import RestoreTiers
    from strata.client.sidecar_client import SidecarClient
    from strata.tiers.ram import RamTier

    config = _one_node_with_a_lost_peer(shm_dir, tmp_path)
    gone = SidecarClient(tmp_path / "no-sidecar.sock")  # nothing listens: the probe fails
    tiers = RestoreTiers(
        config, RamTier(shm_dir / "node0"), "w", partial(peer_source, gone, config)
    )
    assert [t.name for t in tiers.get()] == ["ram"]
    assert len(tiers.notes) == 1, tiers.notes
    assert tiers.notes[0].startswith("peer: not searched: the sidecar did not say"), tiers.notes
    assert "no-sidecar.sock" in tiers.notes[0], tiers.notes


def _erasure_coded_job(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess]
) -> tuple[StrataConfig, Path]:
    """Four nodes save step 130 at four ranks, erasure coded (RS(2, 1): groups of two, one
    parity unit each on another node); node 1 is lost with its RAM and comes back empty, so
    rank 1's shard exists only as parity. Returns the replacement's config and the temporary
    directory its sidecar rebuilds shards into (its TMPDIR)."""
    ca = make_ca()
    ids = [f"worker-{i}" for i in range(NODES)]
    ports = [free_port() for _ in ids]
    peers = [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in zip(ids, ports, strict=True)]

    def config(i: int) -> StrataConfig:
        tls, _ = job_tls(tmp_path / f"tls-{i}-{time.monotonic_ns()}", JOB, ca)
        return StrataConfig.parse(
            {
                "job_id": JOB,
                "ram": {"path": str(shm_dir / f"node{i}"), "keep": 1},
                "metrics_port": free_port(),
                "metrics_host": "127.0.0.1",
                "namespace": "team",
                "pod_name": ids[i],
                "node_name": f"node-{i}",
                "peers": {
                    "mode": "erasure",
                    "data_shards": 2,
                    "parity_shards": 1,
                    "self_id": ids[i],
                    "peers": peers,
                    "listen_host": "127.0.0.1",
                    "port": ports[i],
                    "tls": tls.model_dump(),
                    "poll_seconds": 0.2,
                },
            }
        )

    configs = [config(i) for i in range(NODES)]
    sidecars = [sidecar_proc(c) for c in configs]
    run_job("save", configs, tmp_path / "save")
    stores = [PeerStore(shm_dir / f"node{i}", JOB) for i in range(NODES)]
    deadline = time.monotonic() + 120
    while not all(STEP in s.parity_steps() for s in stores):
        assert time.monotonic() < deadline, [s.logs()[-2000:] for s in sidecars]
        time.sleep(0.1)
    sidecars[1].kill()
    shutil.rmtree(shm_dir / "node1")
    rebuilt = tmp_path / "sidecar-1-tmp"
    rebuilt.mkdir()
    return sidecar_proc(config(1), TMPDIR=str(rebuilt)).config, rebuilt


def test_a_resized_job_reshards_from_erasure_coded_peers_rebuilding_the_lost_shard(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess]
) -> None:
    """The job restarts at two ranks, both on the replacement of the lost node 1: they reshard
    step 130 from the peers, rank 1's shard rebuilt from parity by their sidecar and read by
    ranges through its local API; every tensor as saved, and no rebuilt copy left behind."""
    replacement, rebuilt = _erasure_coded_job(shm_dir, tmp_path, sidecar_proc)
    got = run_job("restore", [replacement, replacement], tmp_path / "restore")
    assert_resharded_from_peer(got)
    assert not list(rebuilt.glob("strata-range-*")), list(rebuilt.iterdir())
    print("4 -> 2 from parity: bytes fetched over the local API, needed, ratio:", ratios(got))


def test_one_rank_closing_keeps_a_rebuilt_shard_another_rank_of_its_node_reads(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Callable[..., SidecarProcess]
) -> None:
    """Two ranks of one node (two peer sources on one sidecar) read the shard their sidecar
    rebuilt from parity: it is rebuilt once; the first closing leaves it to the second, which
    reads on without a rebuild; the last closing removes it."""
    from strata.client.peer_source import PeerSource
    from strata.client.sidecar_client import SidecarClient
    from strata.tiers.references import chunk_span, read_logical

    replacement, rebuilt = _erasure_coded_job(shm_dir, tmp_path, sidecar_proc)
    client = SidecarClient(replacement.socket)
    info = client.peer_info()
    assert info is not None and info.enabled
    first, second = (PeerSource(client, JOB, info.max_range) for _ in range(2))
    assert STEP in first.list_steps(JOB) and 1 in first.list_steps(JOB)[STEP].committed_ranks
    m = first.get_manifest(JOB, STEP, 1)
    n = m.data_nbytes

    def read(source: PeerSource, lo: int, hi: int) -> None:
        # verified against the manifest's CRC32Cs: the bytes rank 1 saved
        lo, hi = chunk_span(m, lo, hi - lo)
        assert len(read_logical(source, JOB, STEP, 1, m, lo, hi)) == hi - lo

    read(first, 0, n // 2)
    copies = list(rebuilt.glob("strata-range-*"))
    assert len(copies) == 1, copies  # rebuilt whole, once
    read(second, n // 2, n)
    read(first, n - 1, n)
    assert list(rebuilt.glob("strata-range-*")) == copies  # the same copy serves both ranks
    first.drop_fetched()  # the first rank's reader closes
    assert list(rebuilt.glob("strata-range-*")) == copies, "removed under the second rank"
    read(second, 0, n)
    assert list(rebuilt.glob("strata-range-*")) == copies  # not rebuilt
    second.drop_fetched()  # the last reader of the node closes: the copy goes
    assert not list(rebuilt.glob("strata-range-*"))
    read(second, 0, 1)  # and a later read rebuilds it
    assert len(list(rebuilt.glob("strata-range-*"))) == 1
    second.drop_fetched()
    assert not list(rebuilt.glob("strata-range-*"))
