"""Peer tier figures (issue 16): Reed-Solomon throughput per core, and the cost of protecting one
step by full replicas vs erasure coding, measured on real peer processes on loopback.

1. **codec**: zfec encode (one parity block of k data blocks: what one holder computes) and
   decode (rebuild one lost data block from k survivors) of 4 MiB blocks, MB/s of data blocks
   processed per CPU second (``time.process_time``, one thread).
2. **per step**: ``N`` real ``python -m strata.peers`` processes (one per "node", RAM directories
   on /dev/shm, mutual TLS on 127.0.0.1), each with one rank's shard of ``S`` MiB committed in its
   RAM tier. Started together; measured until every node has committed its copies/parity of the
   step: per node the bytes pulled (network in), the CPU seconds the peer service spent, the
   tmpfs bytes it holds for others (memory), and the wall time to protect the step.

Usage: ``python -m bench.peers [--nodes 6] [--sizes 64,256] [--out bench/results/peers.json]``.
Wall times on a shared 2-core machine are only indicative; bytes and memory are exact, CPU
seconds are per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.fixtures.peers import job_tls, make_ca
from tests.fixtures.sidecar import write_ram_shard

from strata.peers.config import PeerEndpoint, PeersConfig
from strata.peers.erasure import decode, encode_parity
from strata.peers.store import PeerStore
from strata.testing.ports import free_port
from strata.tiers.ram import RamTier

JOB = "bench.peers"
MiB = 1024 * 1024
CHUNK = 4 * MiB


def codec(k: int, m: int, reps: int = 6) -> dict[str, float]:
    blocks = [os.urandom(CHUNK) for _ in range(k)]
    encode_parity(blocks, m, [0])
    t = time.process_time()
    for _ in range(reps):
        parity = encode_parity(blocks, m, list(range(m)))
    enc = reps * k * CHUNK / (time.process_time() - t) / 1e6
    avail = {i: blocks[i] for i in range(1, k)} | {k: parity[0]}
    t = time.process_time()
    for _ in range(reps):
        out = decode(avail, k, m)
    dec = reps * k * CHUNK / (time.process_time() - t) / 1e6
    assert out[0] == blocks[0]
    return {"k": k, "m": m, "encode_all_parity_MBps": round(enc), "rebuild_MBps": round(dec)}


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_size
    return total


def protect_step(nodes: int, size_mib: int, scheme: dict[str, Any]) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="strata-bench-peers-", dir="/dev/shm"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ca = make_ca()
        ports = [free_port() for _ in range(nodes)]
        peers = tuple(
            PeerEndpoint(id=f"w{i}", address=f"127.0.0.1:{ports[i]}") for i in range(nodes)
        )
        payload = os.urandom(size_mib * MiB)
        for i in range(nodes):
            write_ram_shard(
                RamTier(base / f"ram{i}"),
                JOB,
                1,
                i,
                payload[i:] + payload[:i],
                world_size=nodes,
                chunk_size=CHUNK,
            )
        logs = []
        t0 = time.monotonic()
        for i in range(nodes):
            tls, _ = job_tls(base / f"tls{i}", JOB, ca)
            cfg = PeersConfig(
                self_id=f"w{i}",
                peers=peers,
                listen_host="127.0.0.1",
                port=ports[i],
                tls=tls,
                poll_seconds=0.2,
                bandwidth_bytes_per_second=None,
                **scheme,
            )
            env = dict(os.environ, STRATA_JOB_ID=JOB, STRATA_RAM_DIR=str(base / f"ram{i}"))
            env["STRATA_PEERS"] = cfg.model_dump_json()
            log = base / f"w{i}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        ["nice", "-n", "19", sys.executable, "-m", "strata.peers"],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        stores = [PeerStore(base / f"ram{i}", JOB) for i in range(nodes)]

        def protected(store: PeerStore) -> bool:
            if scheme["mode"] == "erasure":
                return 1 in store.parity_steps()
            return sum(1 for steps in store.replicas().values() if 1 in steps) == scheme["copies"]

        deadline = time.monotonic() + 900
        while not all(protected(s) for s in stores):
            if time.monotonic() > deadline:
                tails = [p.read_text()[-500:] for p in logs]
                raise RuntimeError(f"not every node protected the step: {tails}")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        time.sleep(1.0)  # one more round: its counters include the last copy
        done: dict[int, dict[str, Any]] = {}
        for i, log in enumerate(logs):
            events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            cpu0 = next(e["cpu_seconds"] for e in events if e["event"] == "listening")
            last = [e for e in events if e["event"] == "round"][-1]
            done[i] = last | {"cpu_seconds": last["cpu_seconds"] - cpu0}
        per_node = [done[i] for i in range(nodes)]
        held = [
            _du(base / f"ram{i}" / JOB / "peers") + _du(base / f"ram{i}" / JOB / "parity")
            for i in range(nodes)
        ]
        state = size_mib * MiB
        return {
            "scheme": scheme,
            "nodes": nodes,
            "state_MiB": size_mib,
            "network_in_per_node_x_state": round(
                statistics.mean(e["bytes_in"] for e in per_node) / state, 3
            ),
            "cpu_s_per_node": round(statistics.mean(e["cpu_seconds"] for e in per_node), 2),
            "cpu_s_per_GiB_state": round(
                statistics.mean(e["cpu_seconds"] for e in per_node) / (size_mib / 1024), 2
            ),
            "memory_per_node_x_state_mean": round(statistics.mean(held) / state, 3),
            "memory_per_node_x_state_max": round(max(held) / state, 3),
            "wall_s_to_protect": round(wall, 1),
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(base, ignore_errors=True)


def interference(size_mib: int, rounds: int = 5, steps: int = 20) -> dict[str, Any]:
    """Slowdown of a 1-thread matmul step loop while a peer replicates a ``size_mib`` state at
    the default bandwidth bound (both peer processes at nice 19, as the sidecar runs): windows of
    ``steps`` steps alternate quiet / busy; ``median(busy) / median(quiet) - 1``."""
    import threading

    from bench.interference import StepLoop

    base = Path(tempfile.mkdtemp(prefix="strata-bench-peers-", dir="/dev/shm"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ca = make_ca()
        ports = [free_port(), free_port()]
        peers = tuple(PeerEndpoint(id=f"w{i}", address=f"127.0.0.1:{ports[i]}") for i in range(2))
        write_ram_shard(
            RamTier(base / "ram0"),
            JOB,
            1,
            0,
            os.urandom(size_mib * MiB),
            world_size=1,
            chunk_size=CHUNK,
        )
        for i in range(2):
            tls, _ = job_tls(base / f"tls{i}", JOB, ca)
            cfg = PeersConfig(
                self_id=f"w{i}",
                peers=peers,
                listen_host="127.0.0.1",
                port=ports[i],
                tls=tls,
                poll_seconds=0.2,
            )
            env = dict(os.environ, STRATA_JOB_ID=JOB, STRATA_RAM_DIR=str(base / f"ram{i}"))
            env["STRATA_PEERS"] = cfg.model_dump_json()
            procs.append(
                subprocess.Popen(
                    ["nice", "-n", "19", sys.executable, "-m", "strata.peers"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        holder = PeerStore(base / "ram1", JOB)
        loop = StepLoop(threads=1)
        busy = threading.Event()
        stop = threading.Event()
        copies = 0

        def churn() -> None:
            # Each time the holder has committed the copy, drop it so that it copies again.
            nonlocal copies
            while not stop.is_set():
                if busy.is_set() and 1 in holder.replicas().get("w0", {}):
                    holder.delete_replica_step("w0", 1)
                    copies += 1
                time.sleep(0.01)

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        quiet: list[float] = []
        loaded: list[float] = []
        busy_s = 0.0
        loop.run(steps)
        for _ in range(rounds):
            quiet += loop.run(steps)
            busy.set()
            time.sleep(1.0)  # the copy is under way
            t0 = time.monotonic()
            loaded += loop.run(steps)
            busy_s += time.monotonic() - t0 + 1.0
            busy.clear()
            time.sleep(2.0)  # the copy in flight ends
        stop.set()
        t.join()
        return {
            "state_MiB": size_mib,
            "bandwidth_bound_MiBps": PeersConfig().bandwidth_bytes_per_second // MiB,  # type: ignore[operator]
            "copies_during_busy_windows": copies,
            "step_ms_quiet": round(statistics.median(quiet) * 1000, 1),
            "step_ms_busy": round(statistics.median(loaded) * 1000, 1),
            "interference_fraction": round(
                statistics.median(loaded) / statistics.median(quiet) - 1, 3
            ),
            "replicated_MiBps_while_training": round(copies * size_mib / busy_s, 1),
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--sizes", default="64,256", help="state per node, MiB, comma-separated")
    ap.add_argument("--out", default="bench/results/peers.json")
    ap.add_argument("--only-interference", action="store_true")
    args = ap.parse_args()
    if args.only_interference:
        print(json.dumps(interference(256)), flush=True)
        return
    out: dict[str, Any] = {"codec": [codec(2, 1), codec(3, 2), codec(4, 2), codec(6, 2)]}
    for row in out["codec"]:
        print(json.dumps(row), flush=True)
    schemes = [
        {"mode": "replicate", "copies": 1},
        {"mode": "replicate", "copies": 2},
        {"mode": "erasure", "data_shards": 3, "parity_shards": 1},
        {"mode": "erasure", "data_shards": 3, "parity_shards": 2},
    ]
    out["per_step"] = []
    for size in (int(s) for s in args.sizes.split(",")):
        for scheme in schemes:
            row = protect_step(args.nodes, size, scheme)
            print(json.dumps(row), flush=True)
            out["per_step"].append(row)
    out["interference"] = interference(256)
    print(json.dumps(out["interference"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
