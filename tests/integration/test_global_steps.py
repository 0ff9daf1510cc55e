"""Issue 12: incarnations and the global commit record, with real sidecars and real trainers.

Every trainer is a real process in a gloo process group (``torch.distributed``), talking to the
real ``strata sidecar`` of its "node" (a RAM directory under /dev/shm) over its unix socket; the
PVC is a shared directory (a real size-limited tmpfs for ENOSPC), GCS is fake-gcs-server with the
real client. Each scenario of the issue is one test; each fails on the code before issue 12.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from strata.config import StrataConfig
from strata.format.incarnation import Lineage
from strata.tiers.base import Tier
from strata.tiers.gcs import GcsTier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata.tiers.records import read_commit, read_incarnations, verify_commit
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.sidecar import REPO, SidecarProcess, free_port

pytestmark = pytest.mark.integration

JOB = "ns.global"
Start = Callable[..., SidecarProcess]

_WORKER = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
from strata.client import Checkpointer
from strata.config import StrataConfig

spec = json.load(open(sys.argv[1]))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = StrataConfig.model_validate(spec["configs"][rank])

def weights(seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(256, generator=g)

out = {"restored": None}
with Checkpointer(cfg, reshard=spec.get("reshard")) as c:
    for act in spec["actions"]:
        if "restore" in act:
            live = {"w": torch.zeros(256), "step": -1}
            res = c.restore(live)
            out["restored"] = {"step": res.step, "tier": res.tiers.get(rank, res.tier),
                               "w": live["w"].tolist(), "incarnation": c.incarnation}
        elif "save" in act:
            if act.get("rank", rank) == rank:
                assert c.save(act["save"], {"w": weights(act["seed"]), "step": act["save"]})
                c.wait()
        elif "wait_file" in act:
            if act.get("rank", rank) == rank:
                deadline = time.monotonic() + 120
                while not os.path.exists(act["wait_file"]):
                    assert time.monotonic() < deadline, act["wait_file"]
                    time.sleep(0.05)
        elif "touch" in act:
            if rank == 0:
                open(act["touch"], "w").close()
        elif "barrier" in act:
            dist.barrier()
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as f:
    json.dump(out, f)
"""


def weights(seed: int, rank: int) -> list[float]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return list(torch.randn(256, generator=g).tolist())


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Cluster:
    """Nodes (RAM directories) with one sidecar each, a shared PVC and/or GCS, gloo trainers."""

    def __init__(
        self,
        root: Path,
        start: Start,
        *,
        pvc: Path | None = None,
        gcs: dict[str, Any] | None = None,
        ram_keep: int = 1,
        pvc_every: int = 100,
        gcs_every: int = 10,
    ) -> None:
        self.root = root
        self.start_proc = start
        self.pvc = pvc
        self.gcs = gcs
        self.ram_keep = ram_keep
        self.pvc_every = pvc_every
        self.gcs_every = gcs_every
        self.sidecars: dict[int, SidecarProcess] = {}
        self.runs = 0

    def ram(self, node: int) -> Path:
        return self.root / f"node-{node}"

    def config(self, node: int) -> StrataConfig:
        raw: dict[str, Any] = {
            "job_id": JOB,
            "ram": {"path": str(self.ram(node)), "keep": self.ram_keep},
            "metrics_port": free_port(),
            "metrics_host": "127.0.0.1",
            "writer_id": f"node-{node}",
            "termination_grace_seconds": 30,
            "restore": {"allow_fresh_start": True},
        }
        if self.pvc is not None:
            raw["pvc"] = {"path": str(self.pvc), "every": {"steps": self.pvc_every}, "keep": 2}
        if self.gcs is not None:
            raw["gcs"] = {**self.gcs, "every": {"steps": self.gcs_every}, "keep": 2}
        return StrataConfig.parse(raw)

    def start_sidecar(self, node: int) -> SidecarProcess:
        self.ram(node).mkdir(parents=True, exist_ok=True)
        sp = self.start_proc(self.config(node))
        self.sidecars[node] = sp
        return sp

    def kill_sidecar(self, node: int) -> None:
        self.sidecars.pop(node).kill()

    def lose_node(self, node: int) -> None:
        if node in self.sidecars:
            self.kill_sidecar(node)
        shutil.rmtree(self.ram(node), ignore_errors=True)

    def train(
        self,
        world: int,
        actions: list[dict[str, Any]],
        nodes: list[int] | None = None,
        reshard: bool | None = None,
    ) -> list[dict[str, Any]]:
        """Run ``world`` trainer ranks (rank r on node ``nodes[r]``, default node r) to the end.
        ``reshard``: the Checkpointer's (None: its default, resharding when the state allows)."""
        nodes = nodes or list(range(world))
        self.runs += 1
        out = self.root / f"run-{self.runs}"
        out.mkdir()
        spec = {
            "configs": [self.config(n).model_dump(mode="json") for n in nodes],
            "actions": actions,
            "out": str(out),
            "reshard": reshard,
        }
        (out / "spec.json").write_text(json.dumps(spec))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sidecar"), str(REPO)])
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(out / "spec.json")],
                env={**env, "RANK": str(r)},
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
        return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def committed(tier: Tier, step: int) -> dict[str, Any] | None:
    """The step's verifying commit record in ``tier`` that still matches its shards, or None."""
    c = read_commit(tier, JOB, step)
    if c is None or verify_commit(tier, c):
        return None
    return {"incarnation": c.incarnation, "world_size": c.world_size}


def commit_path(root: Path, step: int) -> Path:
    return root / JOB / "steps" / f"{step:012d}" / "commit.json"


def live(tier: Tier, step: int) -> bool:
    c = read_commit(tier, JOB, step)
    return c is not None and Lineage(read_incarnations(tier, JOB)).live(c.incarnation, step)


def restored_ok(results: list[dict[str, Any]], step: int | None, seed: int) -> bool:
    return all(
        r["restored"]["step"] == step and (step is None or r["restored"]["w"] == weights(seed, i))
        for i, r in enumerate(results)
    )


# -- scenarios ---------------------------------------------------------------------------------------


def test_world_size_changes_both_directions_on_the_same_ram_and_pvc_paths(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """4 ranks on one node (one sidecar) commit step 700; the job comes back with 2 ranks on the
    same RAM and PVC paths (700 is not restorable at 2: fresh start), saves 100-300: each is
    committed (a stale step 700 and stale ranks 2-3 in the RAM directory neither set the
    interval nor make the sidecar wait); back to 4 ranks: 700 is superseded (never restored).

    The restores across world sizes opt out of resharding (``reshard=False``): this test is
    about steps of another world size left behind. By default the state here (a plain tensor
    per rank) refuses such a restore instead (tests/integration/test_reshard_default.py)."""
    pvc = tmp_path / "pvc"
    cl = Cluster(shm_dir, sidecar_proc, pvc=pvc, pvc_every=100)
    tier = PosixTier(pvc)
    cl.start_sidecar(0)
    cl.train(4, [{"restore": 1}, {"save": 700, "seed": 7}], nodes=[0] * 4)
    wait_until(lambda: committed(tier, 700) is not None, "step 700 committed at world size 4")
    assert committed(tier, 700)["world_size"] == 4  # type: ignore[index]
    cl.kill_sidecar(0)

    cl.start_sidecar(0)  # a new pod on the same node: ranks 2-3 left slots and shards in RAM
    saves = [
        act
        for s in (100, 200, 300)  # each waits for its commit record: none may be skipped
        for act in ({"save": s, "seed": 2}, {"wait_file": str(commit_path(pvc, s))})
    ]
    res = cl.train(2, [{"restore": 1}, *saves], nodes=[0, 0], reshard=False)
    assert [r["restored"]["step"] for r in res] == [None, None]
    # Each was committed (the trainers waited for it); retention (keep 2) on the live ones only.
    for step in (200, 300):
        assert committed(tier, step)["world_size"] == 2  # type: ignore[index]
    assert committed(tier, 100) is None
    assert not live(tier, 700)
    cl.kill_sidecar(0)

    cl.lose_node(0)  # RAM lost: the PVC alone serves the restore
    cl.start_sidecar(0)
    res = cl.train(2, [{"restore": 1}], nodes=[0, 0])
    assert restored_ok(res, 300, 2) and {r["restored"]["tier"] for r in res} == {"pvc"}
    cl.kill_sidecar(0)

    cl.start_sidecar(0)  # and back to 4 ranks: 300 is of world size 2, 700 superseded
    res = cl.train(4, [{"restore": 1}, {"save": 100, "seed": 9}], nodes=[0] * 4, reshard=False)
    assert [r["restored"]["step"] for r in res] == [None] * 4
    wait_until(
        lambda: (committed(tier, 100) or {}).get("world_size") == 4, "step 100 at world size 4"
    )
    assert not live(tier, 700) and not live(tier, 300) and live(tier, 100)


def _committed_ranks(tier: GcsTier, step: int) -> frozenset[int]:
    listing = tier.list_steps(JOB).get(step)
    return frozenset() if listing is None else listing.committed_ranks


def test_replayed_run_with_other_bytes_never_mixes_incarnations_on_gcs(
    shm_dir: Path, sidecar_proc: Start, gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    """World size 2, GCS only. Step 20 reaches GCS for rank 0 only; both nodes are lost; restore
    gives 10; the replay saves 20 with other bytes: GCS step 20 is the replay's, both ranks."""
    gcs_cfg = gcs_emulator.tier_config(gcs_bucket, prefix="ckpt").model_dump(mode="json")
    cl = Cluster(shm_dir, sidecar_proc, gcs=gcs_cfg, gcs_every=10)
    gcs = GcsTier(gcs_emulator.tier_config(gcs_bucket, prefix="ckpt"), client=gcs_emulator.client())
    for node in (0, 1):
        cl.start_sidecar(node)
    cl.train(2, [{"restore": 1}, {"save": 10, "seed": 1}])
    wait_until(lambda: committed(gcs, 10) is not None, "step 10 committed on GCS")
    cl.kill_sidecar(1)  # rank 1's upload of step 20 never happens
    cl.train(2, [{"restore": 1}, {"save": 20, "seed": 1}])
    # A step is listed from its first object (the data goes up before the manifest): wait for
    # rank 0's commit, not for the listing (asserting right after the listing raced the upload).
    wait_until(lambda: 0 in _committed_ranks(gcs, 20), "rank 0's shard of step 20 committed on GCS")
    assert _committed_ranks(gcs, 20) == frozenset({0})
    cl.lose_node(0)
    cl.lose_node(1)

    for node in (0, 1):
        cl.start_sidecar(node)
    res = cl.train(2, [{"restore": 1}, {"save": 20, "seed": 2}])  # the replay: other bytes
    assert restored_ok(res, 10, 1)
    replay = res[0]["restored"]["incarnation"]
    wait_until(
        lambda: (committed(gcs, 20) or {}).get("incarnation") == replay,
        "the replay's step 20 committed on GCS",
    )
    cl.lose_node(0)
    cl.lose_node(1)
    for node in (0, 1):
        cl.start_sidecar(node)
    res = cl.train(2, [{"restore": 1}])
    assert restored_ok(res, 20, 2), "step 20 must be the replay's bytes on every rank"


def test_multi_rank_sidecar_promotes_a_rank_that_saves_after_its_first_promotion(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """One sidecar serves ranks 0 and 1; its container restarts after the restore (it forgets
    which ranks its trainers declared), and rank 1 saves step 10 only after the sidecar promoted
    rank 0's: step 10 still gets rank 1's shard and its commit record."""
    import threading

    pvc = tmp_path / "pvc"
    cl = Cluster(shm_dir, sidecar_proc, pvc=pvc, pvc_every=10)
    tier = PosixTier(pvc)
    cl.start_sidecar(0)
    flag = tier.manifest_path(JOB, 10, 0)
    restored, restarted = shm_dir / "restored", shm_dir / "restarted"

    def restart_sidecar() -> None:
        wait_until(restored.exists, "the trainers' restore")
        cl.kill_sidecar(0)
        cl.start_sidecar(0)
        restarted.touch()

    helper = threading.Thread(target=restart_sidecar, daemon=True)
    helper.start()
    cl.train(
        2,
        [
            {"restore": 1},
            {"barrier": 1},
            {"touch": str(restored)},
            {"wait_file": str(restarted)},
            {"save": 10, "seed": 3, "rank": 0},
            {"wait_file": str(flag)},  # both ranks: rank 0's shard of 10 was promoted
            {"save": 10, "seed": 3, "rank": 1},
        ],
        nodes=[0, 0],
    )
    wait_until(lambda: committed(tier, 10) is not None, "step 10 committed with both ranks")
    assert committed(tier, 10)["world_size"] == 2  # type: ignore[index]


def test_fast_saves_promote_the_next_eligible_step(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """RAM keep 1 and saves faster than the sidecar looks: step 50 (the PVC's every.steps) left
    RAM before the sidecar saw it; the next eligible step, 60, is promoted instead."""
    pvc = tmp_path / "pvc"
    cl = Cluster(shm_dir, sidecar_proc, pvc=pvc, pvc_every=50)
    cl.ram(0).mkdir(parents=True)
    cl.train(1, [{"restore": 1}, *({"save": s, "seed": s} for s in (40, 50, 60))])
    cl.start_sidecar(0)  # it first looks when RAM holds only 60
    tier = PosixTier(pvc)
    wait_until(lambda: committed(tier, 60) is not None, "step 60 committed on the PVC")


def test_enospc_burst_promotes_the_newest_eligible_step_once_the_tier_accepts_writes(
    shm_dir: Path, sidecar_proc: Start, small_tmpfs: Callable[[int], Path]
) -> None:
    """The PVC is full while step 50 is due: the sidecar gives up on 50 after its attempts; once
    space is back, the newest eligible step (60) is promoted at once, not at step 100."""
    pvc = small_tmpfs(4 * 1024 * 1024)
    (pvc / "ckpt").mkdir()
    ballast = pvc / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:  # fill the file system to the last block
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    cl = Cluster(shm_dir, sidecar_proc, pvc=pvc / "ckpt", pvc_every=50, ram_keep=2)
    tier = PosixTier(pvc / "ckpt")
    sp = cl.start_sidecar(0)
    go = shm_dir / "space-is-back"

    def gave_up_50() -> bool:
        return any(e.get("event") == "gave_up" and e.get("step") == 50 for e in sp.log_events())

    def big(seed: int, step: int) -> dict[str, Any]:
        return {"save": step, "seed": seed}

    import threading

    def free_space_after_give_up() -> None:
        wait_until(gave_up_50, "the sidecar to give up step 50", timeout=180)
        ballast.unlink()
        go.touch()

    helper = threading.Thread(target=free_space_after_give_up, daemon=True)
    helper.start()
    cl.train(1, [{"restore": 1}, big(5, 50), {"wait_file": str(go)}, big(6, 60)])
    helper.join(timeout=1)
    assert go.exists()
    wait_until(lambda: committed(tier, 60) is not None, "step 60 committed once space is back")
    # step 50 may have landed too (a shard refused for want of space is tried again once its
    # backoff ends); what matters is that the newest step did not wait for step 100


def test_sigkill_of_a_sidecar_while_the_global_record_is_written(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """Two nodes; node 1's sidecar is SIGKILLed as soon as its shard of step 10 is committed on
    the PVC (around the time the global record is written). The record is never torn: it is
    either absent or verifies; the surviving sidecar writes or accepts it, and a restarted
    sidecar accepts it without error; the step restores from the PVC alone."""
    pvc = tmp_path / "pvc"
    cl = Cluster(shm_dir, sidecar_proc, pvc=pvc, pvc_every=10)
    tier = PosixTier(pvc)
    cl.start_sidecar(0)
    sp1 = cl.start_sidecar(1)
    killed = threading_kill_when(lambda: tier.manifest_path(JOB, 10, 1).exists(), sp1.proc.pid)
    cl.train(2, [{"restore": 1}, {"save": 10, "seed": 4}])
    killed.join(timeout=120)
    cl.sidecars.pop(1).kill()
    record = tier.root / JOB / "steps" / "000000000010" / "commit.json"
    if record.exists():
        assert committed(tier, 10) is not None, "a commit record present must verify"
    wait_until(lambda: committed(tier, 10) is not None, "the survivor commits step 10")
    sp1 = cl.start_sidecar(1)
    wait_until(lambda: any(e.get("event") == "ready" for e in sp1.log_events()), "restart")
    cl.lose_node(0)
    cl.lose_node(1)
    for node in (0, 1):
        cl.start_sidecar(node)
    res = cl.train(2, [{"restore": 1}])
    assert restored_ok(res, 10, 4) and {r["restored"]["tier"] for r in res} == {"pvc"}


def threading_kill_when(predicate: Callable[[], bool], pid: int) -> Any:
    import threading

    def run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if predicate():
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.001)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_job_restored_again_and_again_keeps_a_bounded_number_of_incarnation_records(
    shm_dir: Path, tmp_path: Path, sidecar_proc: Start
) -> None:
    """20 restores, each followed by a committed step: every restore's record carries its chain,
    the PVC and the node's RAM keep the newest ``KEEP_INCARNATION_RECORDS`` records, and once
    the node is lost the PVC's records alone still restore the newest step with its bytes
    (before: 20 records on each tier, and one more per restore for good)."""
    from strata.tiers.records import KEEP_INCARNATION_RECORDS

    pvc = tmp_path / "pvc"
    cl = Cluster(shm_dir, sidecar_proc, pvc=pvc, pvc_every=10)
    tier = PosixTier(pvc)
    cl.start_sidecar(0)
    cycles = KEEP_INCARNATION_RECORDS + 4
    for i in range(cycles):
        step = 10 * (i + 1)
        res = cl.train(
            1,
            [{"restore": 1}, {"save": step, "seed": i}, {"wait_file": str(commit_path(pvc, step))}],
        )
        assert restored_ok(res, step - 10 if i else None, i - 1), (i, res)
    recs = read_incarnations(tier, JOB)
    assert len(recs) == KEEP_INCARNATION_RECORDS, len(recs)
    newest = max(recs, key=lambda r: (r.created, r.id))
    assert newest.ancestors is not None and len(newest.ancestors) == cycles - 1
    ram_recs = read_incarnations(RamTier(cl.ram(0)), JOB)
    assert len(ram_recs) <= KEEP_INCARNATION_RECORDS + 1, len(ram_recs)
    cl.kill_sidecar(0)
    cl.lose_node(0)
    cl.start_sidecar(0)
    res = cl.train(1, [{"restore": 1}])
    assert restored_ok(res, 10 * cycles, cycles - 1) and res[0]["restored"]["tier"] == "pvc"
