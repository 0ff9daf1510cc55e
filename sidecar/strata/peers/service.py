"""The sidecar's peer service: serve this node's copies to the job's other sidecars, and pull and
keep what placement says this node holds for them (replicas, or erasure-coding parity).

Serving (``GET`` only, mutual TLS, see :mod:`strata.peers.transport`):

- ``/v1/inventory``                                    :class:`~strata.peers.wire.PeerInventory`
- ``/v1/ram/<step>/<rank>/manifest|data``              this node's own committed RAM shards (read
  under a :class:`~strata.tiers.ram.SlotLease`, so the writer never reuses a slot mid-read)
- ``/v1/replica/<owner>/<step>/<rank>/manifest|data``  replicas this node holds
- ``/v1/parity/<step>/record|data``                    this node's parity of a step

``data`` takes ``offset`` and ``length`` (bytes, at most 64 MiB). Errors: 404 (not held), 400.

Background (:meth:`PeerService.run_round`, every ``poll_seconds`` at the sidecar's low priority,
bounded by ``bandwidth_bytes_per_second`` each way): poll the peers' inventories; in ``replicate``
mode copy each owner's newest checksummed RAM step that this node holds replicas of (placement),
verified chunk by chunk, committed data first and the owner's manifest last; in ``erasure`` mode
encode this node's parity chunks of the newest step every peer holds (:mod:`strata.peers.encode`).
Then keep the newest ``keep`` steps per owner / of parity.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from strata.config import StrataConfig
from strata.constants import ENV_FAILURE_DOMAIN
from strata.errors import ConfigError, ShardCorrupt, ShardUnavailable, TierError
from strata.peers import encode
from strata.peers.config import PeersConfig
from strata.peers.directory import PeerDirectory
from strata.peers.placement import PeerSite, PlacementError, replicas_held_by
from strata.peers.pull import copy_shard, fetch_manifest
from strata.peers.store import PeerStore
from strata.peers.tier import PeerTier
from strata.peers.transport import PeerServer, Reply, TokenBucket, tls_context
from strata.peers.wire import MAX_RANGE, PeerInventory, ShardSummary
from strata.tiers.base import parse_manifest
from strata.tiers.ram import RamTier
from strata.tiers.slots import SlotLease

log = logging.getLogger(__name__)

FULL_POLL_ROUNDS = 15
_ROUTE = re.compile(
    r"^/v1/(?:(?P<ram>ram)/(?P<rs>\d+)/(?P<rr>\d+)"
    r"|replica/(?P<owner>[A-Za-z0-9][A-Za-z0-9._-]*)/(?P<ps>\d+)/(?P<pr>\d+)"
    r"|parity/(?P<qs>\d+))/(?P<what>manifest|data|record)$"
)


@dataclass
class RoundResult:
    """What one background round did (for logs, metrics and tests)."""

    copied: list[tuple[str, int, int]] = field(default_factory=list)
    """(owner, step, rank) replicas committed."""
    encoded: list[int] = field(default_factory=list)
    """Steps whose parity this node committed."""
    notes: list[str] = field(default_factory=list)


class PeerService:
    """One sidecar's peer server and background rounds (see the module docstring).

    ``node``/``domain``: this pod's Kubernetes node and failure domain, reported to peers.
    ``on_event(kind, detail)``: called with ``("replicated"|"encoded"|"corrupt_peer", ...)``.
    Raises ``OSError`` when the TLS material is missing or the port is taken.
    """

    def __init__(
        self,
        config: PeersConfig,
        job_id: str,
        ram: RamTier,
        *,
        self_id: str,
        node: str | None = None,
        domain: str | None = None,
        on_event: Callable[[str, Mapping[str, object]], None] | None = None,
        size_limit: int | None = None,
    ) -> None:
        self.config = config
        self.size_limit = size_limit
        """Bytes the whole RAM directory may hold (``ram.size_limit_bytes``); None: unbounded."""
        self.job_id = job_id
        self.ram = ram
        self.me = PeerSite(self_id, node, domain)
        self.store = PeerStore(ram.root, job_id)
        self.egress = TokenBucket(config.bandwidth_bytes_per_second)
        self.ingress = TokenBucket(config.bandwidth_bytes_per_second)
        self.directory = PeerDirectory(
            config, job_id, self_id, tls_context(config.tls, server=False), self.ingress
        )
        self.server = PeerServer(
            (config.listen_host, config.port),
            tls_context(config.tls, server=True),
            job_id,
            self.handle,
            self.egress,
            timeout_seconds=config.timeout_seconds,
        )
        self.on_event = on_event
        self.tier = PeerTier(self.directory)
        """The restore side (RAM -> peer -> PVC -> GCS) over the same clients."""
        self._summaries: dict[tuple[str, int, int], tuple[tuple[int, int], ShardSummary]] = {}
        self._thread: threading.Thread | None = None
        self._owners: set[str] | None = None
        self._rounds = 0

    @classmethod
    def for_sidecar(
        cls,
        config: StrataConfig,
        ram: RamTier,
        on_event: Callable[[str, Mapping[str, object]], None] | None = None,
    ) -> PeerService | None:
        """The service of a sidecar configured with ``config.peers`` (None when off). Its peer id
        is ``peers.self_id``, else the host name (the pod's stable host name under JobSet or an
        Indexed Job); node from ``NODE_NAME``, failure domain from ``STRATA_FAILURE_DOMAIN``."""
        if config.peers is None:
            return None
        self_id = config.peers.self_id or socket.gethostname()
        if config.peers.members and self_id not in {p.id for p in config.peers.members}:
            raise ConfigError(
                f"this sidecar's peer id {self_id!r} (host name) is not among the job's peers; set "
                "peers.self_id or run the pods with stable host names (JobSet, Indexed Job)"
            )
        return cls(
            config.peers,
            config.job_id,
            ram,
            self_id=self_id,
            node=config.node_name,
            domain=os.environ.get(ENV_FAILURE_DOMAIN) or None,
            on_event=on_event,
            size_limit=config.ram.size_limit_bytes,
        )

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self._thread = self.server.serve_in_thread()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.tier.close()

    # -- serving ----------------------------------------------------------------------------------

    def _summary(
        self, path: str, key: tuple[str, int, int], raw: Callable[[], bytes]
    ) -> ShardSummary | None:
        """A shard's summary, re-parsed only when its manifest file changed."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns)
        cached = self._summaries.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            m = parse_manifest(raw(), path, self.job_id, key[1], key[2])
        except (ShardUnavailable, OSError):
            return None
        if not m.verified:
            return None
        summary = ShardSummary.of(m)
        self._summaries[key] = (stamp, summary)
        return summary

    def inventory(self) -> PeerInventory:
        """What this node serves now (own RAM shards with checksums, replicas, parity steps)."""
        ram: list[ShardSummary] = []
        try:
            listings = self.ram.list_steps(self.job_id)
        except TierError:
            listings = {}
        seen: set[tuple[str, int, int]] = set()
        for step, listing in sorted(listings.items()):
            for rank in sorted(listing.committed_ranks):
                path = self.ram.manifest_path(self.job_id, step, rank)
                seen.add(("", step, rank))
                s = self._summary(str(path), ("", step, rank), path.read_bytes)
                if s is not None:
                    ram.append(s)
        replicas: dict[str, list[ShardSummary]] = {}
        for owner, steps in self.store.replicas().items():
            for step, ranks in sorted(steps.items()):
                for rank in ranks:
                    man = self.store.replica_paths(owner, step, rank)[1]
                    seen.add((owner, step, rank))
                    s = self._summary(str(man), (owner, step, rank), man.read_bytes)
                    if s is not None:
                        replicas.setdefault(owner, []).append(s)
        for gone in set(self._summaries) - seen:
            self._summaries.pop(gone, None)
        return PeerInventory(
            job_id=self.job_id,
            peer=self.me.id,
            node=self.me.node,
            domain=self.me.domain,
            ram=ram,
            replicas=replicas,
            parity_steps=self.store.parity_steps(),
        )

    def handle(self, path: str, query: Mapping[str, str]) -> Reply:
        if path == "/v1/inventory":
            return Reply(200, self.inventory().model_dump_json().encode(), "application/json")
        match = _ROUTE.match(path)
        if match is None:
            return Reply(404, f"no such peer endpoint {path}".encode(), "text/plain")
        g = match.groupdict()
        what = g["what"]
        try:
            if g["ram"]:
                return self._serve_ram(int(g["rs"]), int(g["rr"]), what, query)
            if g["owner"]:
                return self._serve_replica(g["owner"], int(g["ps"]), int(g["pr"]), what, query)
            return self._serve_parity(int(g["qs"]), what, query)
        except (FileNotFoundError, ShardUnavailable) as exc:
            return Reply(404, f"not held: {exc}".encode(), "text/plain")
        except ValueError as exc:
            return Reply(400, str(exc).encode(), "text/plain")

    @staticmethod
    def _range(query: Mapping[str, str]) -> tuple[int, int]:
        off, n = int(query.get("offset", "0")), int(query.get("length", "0"))
        if off < 0 or not 0 < n <= MAX_RANGE:
            raise ValueError(f"offset must be >= 0 and 0 < length <= {MAX_RANGE}")
        return off, n

    @staticmethod
    def _read(path: str, off: int, n: int) -> bytes:
        with open(path, "rb") as f:
            return os.pread(f.fileno(), n, off)

    def _serve_ram(self, step: int, rank: int, what: str, query: Mapping[str, str]) -> Reply:
        if what == "record":
            raise ValueError("RAM shards have a manifest and data, no record")
        with SlotLease(self.ram, self.job_id, step, rank, timeout=2.0) as lease:
            if what == "manifest":
                return Reply(200, self.ram.manifest_path(self.job_id, step, rank).read_bytes())
            assert lease.manifest is not None
            off, n = self._range(query)
            n = min(n, max(0, lease.manifest.data_nbytes - off))
            return Reply(200, self._read(str(lease.path), off, n))

    def _serve_replica(
        self, owner: str, step: int, rank: int, what: str, query: Mapping[str, str]
    ) -> Reply:
        data, man = self.store.replica_paths(owner, step, rank)
        if what == "manifest":
            return Reply(200, man.read_bytes())
        if what != "data" or not man.exists():
            raise FileNotFoundError(f"replica {owner} step {step} rank {rank}")
        off, n = self._range(query)
        return Reply(200, self._read(str(data), off, n))

    def _serve_parity(self, step: int, what: str, query: Mapping[str, str]) -> Reply:
        if what == "record":
            return Reply(200, self.store.read_parity_record(step), "application/json")
        if what != "data" or step not in self.store.parity_steps():
            raise FileNotFoundError(f"parity of step {step}")
        off, n = self._range(query)
        return Reply(200, self._read(str(self.store.parity_data_path(step)), off, n))

    # -- background -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Rounds every ``poll_seconds`` until ``stop``; a failed round is logged and retried."""
        while not stop.is_set():
            try:
                result = self.run_round()
                for note in result.notes:
                    log.info("peers: %s", note)
            except Exception:
                log.exception("peer round failed; retrying")
            stop.wait(self.config.poll_seconds)

    def run_round(self) -> RoundResult:
        """One round. Replication polls only the owners it holds copies of, and every peer
        every ``FULL_POLL_ROUNDS`` rounds (placement may change with nodes and domains):
        polling everyone every round is N^2 requests per round across the job."""
        result = RoundResult()
        partial = self.config.mode == "replicate" and self._rounds % FULL_POLL_ROUNDS != 0
        only = self._owners if partial else None
        self._rounds += 1
        invs, notes = self.directory.inventories(only)
        result.notes.extend(notes)
        sites = self.directory.sites(self.me)
        try:
            if self.config.mode == "replicate":
                self._owners = set(replicas_held_by(sites, self.me.id, self.config.copies))
                self._replicate(invs, sites, result)
            else:
                encode.encode_round(self, invs, sites, result)
        except PlacementError as exc:
            result.notes.append(f"placement: {exc}")
        return result

    def emit(self, kind: str, **detail: object) -> None:
        if self.on_event is not None:
            self.on_event(kind, detail)

    def _replicate(
        self, invs: Mapping[str, PeerInventory], sites: list[PeerSite], result: RoundResult
    ) -> None:
        held = self.store.replicas()
        owners = replicas_held_by(sites, self.me.id, self.config.copies)
        for stale in set(held) - set(owners):
            # No longer ours to hold (a peer's node became known to be ours): drop the copies
            # once the owner has a newer step, which its new holders copy.
            inv = invs.get(stale)
            if inv is not None and inv.ram and max(s.step for s in inv.ram) > max(held[stale]):
                for step in self.store.replica_steps(stale):
                    self.store.delete_replica_step(stale, step)
        for owner in owners:
            inv = invs.get(owner)
            if inv is None or not inv.ram:
                continue
            newest = max(s.step for s in inv.ram)
            shards = [s for s in inv.ram if s.step == newest]
            have = set(held.get(owner, {}).get(newest, []))
            for shard in shards:
                if shard.rank not in have and self._copy_replica(owner, shard, result):
                    have.add(shard.rank)
            # The owner's ranks: every rank it lists at any step, or that we hold a copy of. Its
            # ranks checksum one by one, so the newest step may still lack some: older copies go
            # only once the newest is complete here.
            ranks = {s.rank for s in inv.ram}
            ranks.update(r for rs in held.get(owner, {}).values() for r in rs)
            if have >= ranks:
                self._retain_replicas(owner, newest)

    def fits(self, nbytes: int, result: RoundResult, what: str) -> bool:
        """Whether ``nbytes`` more fit in the RAM tier's size limit (the emptyDir ``sizeLimit``:
        the kubelet evicts a pod whose emptyDir outgrows it); notes it when not."""
        if self.size_limit is None:
            return True
        used = self.store.ram_usage()
        if used + nbytes <= self.size_limit:
            return True
        result.notes.append(
            f"{what} not kept: {used} + {nbytes} bytes would exceed the RAM tier's size limit "
            f"{self.size_limit} (ram.size_limit_bytes); the webhook must size the RAM tier for "
            "the peer copies (docs/peers.md)"
        )
        return False

    def _copy_replica(self, owner: str, shard: ShardSummary, result: RoundResult) -> bool:
        if not self.fits(shard.data_nbytes, result, f"replica of {owner} step {shard.step}"):
            return False
        client = self.directory.client(owner)
        base = f"/v1/ram/{shard.step}/{shard.rank}"
        tmp = self.store.temp_data(owner, shard.step, shard.rank)
        try:
            raw, m = fetch_manifest(client, base, self.job_id, shard.step, shard.rank)
            copy_shard(client, base, m, tmp)
            self.store.commit_replica(owner, shard.step, shard.rank, tmp, raw)
        except ShardCorrupt as exc:
            result.notes.append(f"replica of {owner} step {shard.step} rank {shard.rank}: {exc}")
            self.emit("corrupt_peer", peer=owner, step=shard.step, rank=shard.rank)
            return False
        except (ShardUnavailable, OSError) as exc:
            result.notes.append(f"replica of {owner} step {shard.step} rank {shard.rank}: {exc}")
            return False
        finally:
            if tmp.exists():
                tmp.unlink()
        result.copied.append((owner, shard.step, shard.rank))
        self.emit("replicated", peer=owner, step=shard.step, rank=shard.rank, nbytes=m.data_nbytes)
        return True

    def _retain_replicas(self, owner: str, newest: int) -> None:
        """Keep ``newest`` (complete) and the ``keep - 1`` newest committed steps before it."""
        older = sorted(s for s in self.store.replicas().get(owner, {}) if s < newest)
        keep = (
            {newest, *older[len(older) - (self.config.keep - 1) :]}
            if self.config.keep > 1
            else {newest}
        )
        for step in self.store.replica_steps(owner):
            if step not in keep and step < newest:
                self.store.delete_replica_step(owner, step)
