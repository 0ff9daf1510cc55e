"""Peer tier with real processes (issue 16): each "node" is a real ``python -m strata.peers``
process with its own RAM directory on the machine's tmpfs, talking mutual TLS on loopback.

A node is lost by SIGKILLing its process and wiping its RAM directory; its replacement (same peer
id, empty RAM, a new process) restores through the real restore code (inventory, plan, staging)
with the tier order RAM -> peer -> PVC.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from strata.peers.config import PeerEndpoint, PeersConfig, PeerTlsConfig
from strata.peers.directory import PeerDirectory
from strata.peers.placement import PeerSite, replica_holders
from strata.peers.service import PeerService
from strata.peers.store import PeerStore
from strata.peers.tier import PeerTier
from strata.peers.transport import (
    NotAMember,
    PeerClient,
    PeerError,
    PeerServer,
    Reply,
    TokenBucket,
    tls_context,
)
from strata.restore import collect_inventory, plan_restore, stage_shard
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier
from strata_operator.admission.peers import peer_secret_data, peer_secret_name
from tests.fixtures.peers import JobCa, job_tls, make_ca
from tests.fixtures.sidecar import flip_byte, free_port, write_ram_shard

pytestmark = pytest.mark.integration

JOB = "team.peers-job"
ORDER = ("ram", "peer", "pvc")
CHUNK = 64 * 1024
RAM_STEP, PVC_STEP = 130, 100


@dataclass
class Node:
    id: str
    ram_dir: Path
    tls: PeerTlsConfig
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def ram(self) -> RamTier:
        return RamTier(self.ram_dir)

    @property
    def store(self) -> PeerStore:
        return PeerStore(self.ram_dir, JOB)


@dataclass
class Cluster:
    base: Path
    mode: str
    k: int
    m: int
    copies: int
    ca: JobCa
    nodes: list[Node] = field(default_factory=list)
    shards: dict[int, bytes] = field(default_factory=dict)
    """rank -> bytes of its RAM step."""
    tiers: list[PeerTier] = field(default_factory=list)
    ranks_per_node: int = 1

    def config(self, node: Node) -> PeersConfig:
        return PeersConfig(
            mode=self.mode,
            copies=self.copies,
            data_shards=self.k,
            parity_shards=self.m,
            self_id=node.id,
            peers=tuple(PeerEndpoint(id=n.id, address=f"127.0.0.1:{n.port}") for n in self.nodes),
            listen_host="127.0.0.1",
            port=node.port,
            tls=node.tls,
            poll_seconds=0.2,
            bandwidth_bytes_per_second=None,
        )

    def start(self, node: Node) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
        env.update(
            STRATA_JOB_ID=JOB,
            STRATA_RAM_DIR=str(node.ram_dir),
            STRATA_PEERS=self.config(node).model_dump_json(),
            NODE_NAME=f"node-of-{node.id}",
        )
        node.log = self.base / f"{node.id}-{time.monotonic_ns()}.log"
        with open(node.log, "wb") as out:
            node.proc = subprocess.Popen(
                [sys.executable, "-m", "strata.peers"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def lose(self, node: Node) -> None:
        """The node dies: its process is killed and its RAM (steps, copies, parity) is gone."""
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait(30)
        shutil.rmtree(node.ram_dir)
        node.ram_dir.mkdir()

    def replacement_tier(self, node: Node) -> PeerTier:
        """The restore side of the replacement pod: same peer id, fresh certificate of the job."""
        tls, _ = job_tls(self.base / f"tls-{node.id}-new", JOB, self.ca)
        cfg = self.config(node).model_copy(update={"tls": tls})
        directory = PeerDirectory(
            cfg, JOB, node.id, tls_context(tls, server=False), TokenBucket(None)
        )
        tier = PeerTier(directory)
        self.tiers.append(tier)
        return tier

    def replicated(self) -> bool:
        """Every node's RAM step is copied to the holders placement gives it."""
        sites = [PeerSite(n.id) for n in self.nodes]
        by_id = {n.id: n for n in self.nodes}
        return all(
            len(by_id[h].store.replicas().get(owner.id, {}).get(RAM_STEP, []))
            == self.ranks_per_node
            for owner in self.nodes
            for h in replica_holders(sites, owner.id, self.copies)
        )

    def wait(self, what: str, done: Callable[[], bool], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return
            for n in self.nodes:
                if n.proc is not None and n.proc.poll() is not None:
                    raise AssertionError(f"{n.id} exited:\n{n.log.read_text() if n.log else ''}")
            time.sleep(0.1)
        logs = "\n".join(n.log.read_text()[-3000:] for n in self.nodes if n.log)
        raise AssertionError(f"{what} not done within {timeout}s:\n{logs}")


@pytest.fixture
def cluster(shm_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(
        n: int, mode: str, *, k: int = 2, m: int = 1, copies: int = 1, ranks_per_node: int = 1
    ) -> Cluster:
        c = Cluster(tmp_path, mode, k, m, copies, make_ca(), ranks_per_node=ranks_per_node)
        for i in range(n):
            d = shm_dir / f"node{i}"
            d.mkdir()
            tls, _ = job_tls(tmp_path / f"tls{i}", JOB, c.ca)
            c.nodes.append(Node(f"worker-{i}", d, tls, free_port()))
        world = n * ranks_per_node
        pvc = PosixTier(tmp_path / "pvc", "pvc")
        for i, node in enumerate(c.nodes):
            for j in range(ranks_per_node):
                rank = i * ranks_per_node + j
                # Several chunks, ragged sizes: units and columns do not line up by accident.
                data = os.urandom(5 * CHUNK + 1000 * rank + 17)
                c.shards[rank] = data
                write_ram_shard(
                    node.ram, JOB, RAM_STEP, rank, data, world_size=world, chunk_size=CHUNK
                )
                old = tmp_path / f"old-{rank}"
                old.write_bytes(data[::-1])
                m_old = write_ram_shard(
                    RamTier(tmp_path / "scratch"),
                    JOB,
                    PVC_STEP,
                    rank,
                    data[::-1],
                    world_size=world,
                    chunk_size=CHUNK,
                )
                pvc.put_shard(JOB, PVC_STEP, rank, old, m_old)
        for node in c.nodes:
            c.start(node)
        made.append(c)
        return c

    yield make
    for c in made:
        for tier in c.tiers:
            tier.close()
        for node in c.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(30)


def restore(c: Cluster, node: Node, tier: PeerTier, ranks: list[int]) -> tuple[int, list[str]]:
    """Plan and stage like the client: the planned step and each rank's serving tier.

    Bytes staged are checked against what the lost node had saved (bit-identical)."""
    world = len(c.shards)
    ram = RamTier(node.ram_dir)
    pvc = PosixTier(c.base / "pvc", "pvc")
    tiers = [ram, tier, pvc]
    invs = [collect_inventory(tiers, JOB, r, world) for r in range(world)]
    plan = plan_restore(invs, world, order=ORDER)
    assert plan is not None
    served = []
    for r in ranks:
        sources = [t for t in tiers if t.name in plan.sources[r]]
        res = stage_shard(sources, JOB, plan.step, r, c.base / f"staged-{r}", world_size=world)
        expected = c.shards[r] if plan.step == RAM_STEP else c.shards[r][::-1]
        assert res.path.read_bytes()[: res.nbytes] == expected
        served.append(res.tier)
    return plan.step, served


def test_replication_restores_a_lost_node_bit_identical(cluster: Callable[..., Cluster]) -> None:
    c = cluster(3, "replicate", ranks_per_node=2)
    c.wait(
        "replication",
        lambda: all(
            sum(len(ranks) for steps in n.store.replicas().values() for ranks in steps.values())
            == 2
            for n in c.nodes
        ),
    )
    lost = c.nodes[1]
    c.lose(lost)
    tier = c.replacement_tier(lost)
    step, served = restore(c, lost, tier, [2, 3])
    assert step == RAM_STEP  # one RAM interval, not the PVC's
    assert served == ["peer", "peer"]


def test_a_newer_step_replaces_the_copy_once_complete(cluster: Callable[..., Cluster]) -> None:
    c = cluster(2, "replicate")
    owner, holder = c.nodes
    c.wait("first copy", lambda: RAM_STEP in holder.store.replicas().get(owner.id, {}))
    newer = os.urandom(3 * CHUNK + 5)
    write_ram_shard(owner.ram, JOB, RAM_STEP + 10, 0, newer, world_size=2, chunk_size=CHUNK)
    c.wait(
        "the newer step replaces the older copy",
        lambda: holder.store.replicas().get(owner.id, {}) == {RAM_STEP + 10: [0]},
    )
    data, _man = holder.store.replica_paths(owner.id, RAM_STEP + 10, 0)
    assert data.read_bytes() == newer


def test_a_lying_peer_is_detected_and_skipped(cluster: Callable[..., Cluster]) -> None:
    c = cluster(3, "replicate", copies=2)
    c.wait("two copies of every node", c.replicated)
    lost = c.nodes[0]
    c.lose(lost)
    tier = c.replacement_tier(lost)
    tier.list_steps(JOB)
    liar_id, _base = tier.copies(RAM_STEP, 0)[0]
    liar = next(n for n in c.nodes if n.id == liar_id)
    flip_byte(liar.store.replica_paths(lost.id, RAM_STEP, 0)[0], offset=3 * CHUNK + 5)
    step, served = restore(c, lost, tier, [0])
    assert (step, served) == (RAM_STEP, ["peer"])
    assert any(liar_id in note and "corrupt" in note for note in tier.notes), tier.notes


def _wait_parity(c: Cluster) -> None:
    c.wait("parity on every node", lambda: all(RAM_STEP in n.store.parity_steps() for n in c.nodes))


def test_erasure_coding_survives_m_lost_nodes(cluster: Callable[..., Cluster]) -> None:
    c = cluster(6, "erasure", k=3, m=2)
    _wait_parity(c)
    lost = [c.nodes[1], c.nodes[2]]
    for n in lost:
        c.lose(n)
    tier = c.replacement_tier(lost[0])
    step, served = restore(c, lost[0], tier, [1, 2])
    assert step == RAM_STEP
    assert served == ["peer", "peer"]
    # Each survivor holds 2/3 of a state in parity (RS(3, 2) over 6 nodes), not full copies.
    parity = [n.store.parity_data_path(RAM_STEP).stat().st_size for n in c.nodes if n not in lost]
    assert max(parity) < min(len(d) for d in c.shards.values())


def test_erasure_coding_beyond_m_falls_back_to_the_pvc_with_a_note(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(4, "erasure", k=2, m=1)
    _wait_parity(c)
    lost = [c.nodes[0], c.nodes[1]]
    for n in lost:
        c.lose(n)
    tier = c.replacement_tier(lost[0])
    step, served = restore(c, lost[0], tier, [0, 1])
    assert step == PVC_STEP
    assert served == ["pvc", "pvc"]
    assert any("more nodes lost than the parity tolerates" in n for n in tier.notes), tier.notes


# -- membership ----------------------------------------------------------------------------------


@pytest.fixture
def lone_service(shm_dir: Path, tmp_path: Path) -> Iterator[tuple[PeerService, JobCa]]:
    tls, ca = job_tls(tmp_path / "server", JOB)
    port = free_port()
    cfg = PeersConfig(
        self_id="worker-0",
        peers=(PeerEndpoint(id="worker-0", address=f"127.0.0.1:{port}"),),
        listen_host="127.0.0.1",
        port=port,
        tls=tls,
    )
    ram = RamTier(shm_dir)
    write_ram_shard(ram, JOB, 7, 0, b"weights" * 1000, chunk_size=CHUNK)
    svc = PeerService(cfg, JOB, ram, self_id="worker-0")
    svc.start()
    try:
        yield svc, ca
    finally:
        svc.close()


def _get(port: int, ctx: ssl.SSLContext | None) -> bytes:
    if ctx is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    try:
        conn.request("GET", "/v1/ram/7/0/data?offset=0&length=100")
        return conn.getresponse().read()
    finally:
        conn.close()


def _client_ctx(tls: PeerTlsConfig | None, ca_path: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=ca_path)
    if tls is not None:
        ctx.load_cert_chain(tls.cert_path, tls.key_path)
    return ctx


def test_unauthenticated_clients_are_refused(
    lone_service: tuple[PeerService, JobCa], tmp_path: Path
) -> None:
    svc, ca = lone_service
    ca_path = svc.config.tls.ca_path
    member, _ = job_tls(tmp_path / "member", JOB, ca)
    assert _get(svc.port, _client_ctx(member, ca_path)) == (b"weights" * 1000)[:100]

    other_job, _ = job_tls(tmp_path / "other-job", "team.other", ca)
    foreign_ca, _ = job_tls(tmp_path / "foreign", JOB)
    attempts = {
        "plain HTTP": None,
        "TLS without a client certificate": _client_ctx(None, ca_path),
        "a certificate of another job (same CA)": _client_ctx(other_job, ca_path),
        "a certificate of another CA": _client_ctx(foreign_ca, ca_path),
    }
    for what, ctx in attempts.items():
        refused_before = svc.server.refused
        try:
            body = _get(svc.port, ctx)
        except (OSError, ssl.SSLError, http.client.HTTPException):
            body = b""
        assert b"weights" not in body, what
        deadline = time.monotonic() + 30
        while svc.server.refused == refused_before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert svc.server.refused > refused_before, what


def test_a_server_of_another_job_is_refused_by_the_client(
    lone_service: tuple[PeerService, JobCa], tmp_path: Path
) -> None:
    svc, ca = lone_service
    member, _ = job_tls(tmp_path / "member", "team.other", ca)
    cfg = PeersConfig(
        self_id="worker-1",
        peers=(
            PeerEndpoint(id="worker-0", address=f"127.0.0.1:{svc.port}"),
            PeerEndpoint(id="worker-1", address="127.0.0.1:1"),
        ),
        tls=member,
    )
    directory = PeerDirectory(
        cfg, "team.other", "worker-1", tls_context(member, server=False), TokenBucket(None)
    )
    with pytest.raises(PeerError) as err:
        directory.inventory("worker-0")
    directory.close()
    assert isinstance(err.value, NotAMember) or "certificate" in str(err.value)
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5):
        pass  # the port is open: refusal is by identity, not by an unreachable server


# -- the operator's per-job Secret ----------------------------------------------------------


def _mount(directory: Path, job_id: str) -> PeerTlsConfig:
    directory.mkdir()
    for name, pem in peer_secret_data(job_id).items():
        (directory / name).write_bytes(pem)
    return PeerTlsConfig(
        ca_path=str(directory / "ca.crt"),
        cert_path=str(directory / "tls.crt"),
        key_path=str(directory / "tls.key"),
    )


def test_peer_secret_proves_membership_of_its_job_only(tmp_path: Path) -> None:
    """The Secret as mounted works for the sidecar's real TLS server and client; another job's
    Secret does not."""
    tls = _mount(tmp_path / "job", "ns.train")
    server = PeerServer(
        ("127.0.0.1", 0),
        tls_context(tls, server=True),
        "ns.train",
        lambda path, query: Reply(200, b"member"),
        TokenBucket(None),
    )
    server.serve_in_thread()
    try:
        endpoint = PeerEndpoint(id="w0", address=f"127.0.0.1:{server.server_address[1]}")
        member = PeerClient(endpoint, tls_context(tls, server=False), "ns.train", TokenBucket(None))
        assert member.get("/v1/inventory") == b"member"
        member.close()
        other = _mount(tmp_path / "other", "ns.other")
        stranger = PeerClient(
            endpoint, tls_context(other, server=False), "ns.other", TokenBucket(None)
        )
        with pytest.raises(PeerError):
            stranger.get("/v1/inventory")
    finally:
        server.shutdown()
        server.server_close()
    assert peer_secret_name("ns.train").startswith("strata-peers-")
    assert len(peer_secret_name("x" * 300)) <= 63


def test_copies_never_outgrow_the_ram_tier_size_limit(shm_dir: Path, tmp_path: Path) -> None:
    """The kubelet evicts a pod whose emptyDir outgrows its sizeLimit: a copy that would not fit
    is not made, and the round says why."""
    ca = make_ca()
    ports = [free_port(), free_port()]
    peers = tuple(PeerEndpoint(id=f"w{i}", address=f"127.0.0.1:{ports[i]}") for i in range(2))
    services = []
    for i in range(2):
        tls, _ = job_tls(tmp_path / f"tls{i}", JOB, ca)
        cfg = PeersConfig(
            self_id=f"w{i}", peers=peers, listen_host="127.0.0.1", port=ports[i], tls=tls
        )
        ram = RamTier(shm_dir / f"n{i}")
        if i == 0:
            write_ram_shard(
                ram, JOB, RAM_STEP, 0, os.urandom(4 * CHUNK), world_size=1, chunk_size=CHUNK
            )
        limit = 2 * CHUNK if i == 1 else None
        services.append(PeerService(cfg, JOB, ram, self_id=f"w{i}", size_limit=limit))
    try:
        for s in services:
            s.start()
        result = services[1].run_round()
        assert not result.copied
        assert any("size limit" in n for n in result.notes), result.notes
        assert services[1].store.replicas() == {}
        services[1].size_limit = 64 * CHUNK
        assert services[1].run_round().copied == [("w0", RAM_STEP, 0)]
    finally:
        for s in services:
            s.close()


class _CountingPeerTier(PeerTier):
    """The real peer tier, counting whole-shard fetches and the bytes of its ranged reads."""

    fetches = 0
    read_bytes = 0

    def fetch_shard(self, job_id: str, step: int, rank: int, dst_path: Path, verify: bool = True):  # type: ignore[no-untyped-def]
        type(self).fetches += 1
        return super().fetch_shard(job_id, step, rank, dst_path, verify)

    def read_range(self, job_id: str, step: int, rank: int, offset: int, nbytes: int) -> bytes:
        data = super().read_range(job_id, step, rank, offset, nbytes)
        type(self).read_bytes += len(data)
        return data


def _counting(c: Cluster, node: Node) -> _CountingPeerTier:
    tier = _CountingPeerTier(c.replacement_tier(node).directory)
    c.tiers.append(tier)
    _CountingPeerTier.fetches = _CountingPeerTier.read_bytes = 0
    return tier


def test_ranged_reads_from_a_peer_copy_transfer_only_the_range(
    cluster: Callable[..., Cluster],
) -> None:
    """A resharding read of a lost rank's shard from a peer's replica: ranged GETs of the
    chunks asked for, verified; never the whole shard."""
    from strata.tiers.references import read_logical

    c = cluster(3, "replicate")
    c.wait("replication", c.replicated)
    lost = c.nodes[1]
    c.lose(lost)
    tier = _counting(c, lost)
    m = tier.get_manifest(JOB, RAM_STEP, 1)
    got = read_logical(tier, JOB, RAM_STEP, 1, m, CHUNK, 3 * CHUNK)
    assert bytes(got) == c.shards[1][CHUNK : 3 * CHUNK]
    end = read_logical(tier, JOB, RAM_STEP, 1, m, 5 * CHUNK, m.data_nbytes)
    assert bytes(end) == c.shards[1][5 * CHUNK :]
    assert _CountingPeerTier.fetches == 0
    assert _CountingPeerTier.read_bytes == 2 * CHUNK + m.data_nbytes - 5 * CHUNK


def test_ranged_reads_of_a_rebuilt_shard_rebuild_it_once(cluster: Callable[..., Cluster]) -> None:
    """A shard only an erasure rebuild can serve is rebuilt once per reader, not per range."""
    from strata.tiers.references import read_logical

    c = cluster(6, "erasure", k=3, m=2)
    _wait_parity(c)
    lost = [c.nodes[1], c.nodes[2]]
    for n in lost:
        c.lose(n)
    tier = _counting(c, lost[0])
    m = tier.get_manifest(JOB, RAM_STEP, 1)
    for lo, hi in ((0, CHUNK), (2 * CHUNK, 4 * CHUNK), (CHUNK, 2 * CHUNK)):
        assert bytes(read_logical(tier, JOB, RAM_STEP, 1, m, lo, hi)) == c.shards[1][lo:hi]
    assert _CountingPeerTier.fetches == 1
    tier.drop_fetched()  # the reader closed: a later read rebuilds it again
    assert bytes(read_logical(tier, JOB, RAM_STEP, 1, m, 0, CHUNK)) == c.shards[1][:CHUNK]
    assert _CountingPeerTier.fetches == 2


def test_the_peer_tier_is_a_reshard_source_when_it_holds_every_shard_of_a_step(
    cluster: Callable[..., Cluster],
) -> None:
    """A 3-rank step whose node 0 is lost: the replacement's peer tier still holds every rank's
    shard (node 1's and node 2's RAM, node 0's replica), so a job resized to 2 ranks can
    reshard it from the peers, reading only the ranges it asks for (never whole shards)."""
    from strata.client.sharded import ShardReader
    from strata.restore.reshard import pick_reshard, reshard_sources

    c = cluster(3, "replicate")
    c.wait("replication", c.replicated)
    lost = c.nodes[0]
    c.lose(lost)
    tier = _counting(c, lost)
    ram = RamTier(lost.ram_dir)
    got = reshard_sources([ram, tier], JOB, 0, 2, shared=False)
    inc = tier.get_manifest(JOB, RAM_STEP, 0).incarnation
    assert got["sources"] == [
        {"step": RAM_STEP, "world_size": 3, "incarnation": inc, "tier": "peer"}
    ]
    # the peer tier serves the ranks that reported it: rank 1's node offers it too
    other = {**got, "rank": 1}
    choice = pick_reshard([got, other], 2, ORDER)
    assert choice is not None and choice.step == RAM_STEP and choice.saved_world_size == 3
    assert choice.sources == {0: ("peer",), 1: ("peer",)}
    assert pick_reshard([got], 2, ORDER) is None  # rank 1 reported no source
    # the reshard read: ranges of every saved rank from the peers, verified, never whole shards
    reader = ShardReader([tier], JOB, RAM_STEP, inc)
    for r in range(3):
        lo, n = CHUNK + 100, CHUNK // 2
        assert bytes(reader.read(r, lo, n)) == c.shards[r][lo : lo + n]
    assert reader.served == ["peer"]
    assert _CountingPeerTier.fetches == 0
    assert _CountingPeerTier.read_bytes == reader.nbytes_read == 3 * CHUNK
    reader.close()


def test_the_peer_tier_is_no_reshard_source_without_every_shard(
    cluster: Callable[..., Cluster],
) -> None:
    """Two of three nodes lost with one replica each: some rank's shard is on no peer, so the
    step is no reshard source there."""
    from strata.restore.reshard import reshard_sources

    c = cluster(3, "replicate")
    c.wait("replication", c.replicated)
    for n in c.nodes[:2]:
        c.lose(n)
    tier = c.replacement_tier(c.nodes[0])
    assert len(tier.list_steps(JOB)[RAM_STEP].committed_ranks) < 3
    assert reshard_sources([tier], JOB, 0, 2, shared=False)["sources"] == []
