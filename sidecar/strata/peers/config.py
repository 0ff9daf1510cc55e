"""Configuration of the peer tier: one frozen pydantic model, part of the Strata config.

The webhook fills it from the CheckpointPolicy (``spec.peers``) and the workload: the peers are
the pod names the workload controller gives (JobSet:
``<jobset>-<rjob>-<job index>-<pod index>.<subdomain>``), so no sidecar needs Kubernetes API
access to discover its peers. The webhook sends them as :class:`PeerRange` patterns (a few
hundred bytes whatever the job's size), which the sidecar expands into :attr:`PeersConfig.members`;
a pod that carried the whole list made every pod of an n-pod job O(n) bytes (about 85 bytes a
peer), so the job O(n^2) in etcd: 4,096 peers pods filled a 2 GiB etcd. Outside Kubernetes (tests,
the demo) the list can be static (``peers``).

Errors: invalid combinations raise ``ValueError`` at construction naming the conflict (pydantic
turns it into the ``ConfigError`` of :mod:`strata.config`).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections import Counter
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

DEFAULT_PEER_PORT = 8477
DEFAULT_TLS_DIR = "/var/run/secrets/strata.dev/peers"
PEER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_PEER_ID_RE = re.compile(PEER_ID_PATTERN)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PeerEndpoint(_Frozen):
    """One sidecar of the job as its peers reach it.

    ``id``: stable identity of the pod slot (JobSet pod hostname), the same after the pod is
    recreated on another node; replicas are filed under it. ``address``: ``host:port``.
    ``node`` and ``domain`` are optional hints; each sidecar also reports its own (NODE_NAME,
    the failure-domain label) in its inventory, which placement prefers.
    """

    id: Annotated[str, Field(min_length=1, max_length=253, pattern=PEER_ID_PATTERN)]
    address: Annotated[str, Field(min_length=3, pattern=r"^[^\s/]+:\d{1,5}$")]
    node: str | None = None
    domain: str | None = None


class PeerRange(_Frozen):
    """Peers named the way a workload controller names its pods, without listing them.

    Host names: ``{prefix}{i}`` for ``0 <= i < count`` or, with ``groups``, ``{prefix}{g}-{i}``
    for ``0 <= g < groups`` and ``0 <= i < count``. JobSet: prefix ``<jobset>-<rjob>-``, groups
    the replicated job's replicas, count its pods per job; Indexed Job: prefix ``<job>-``, count
    its completions. A peer's id is its host name, its address ``{host}.{domain}:{port}``.
    """

    prefix: Annotated[str, Field(min_length=1, max_length=200, pattern=PEER_ID_PATTERN)]
    groups: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    count: Annotated[int, Field(ge=1, le=1_000_000)]
    domain: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.-]+$")]
    port: Annotated[int, Field(ge=1, le=65535)]

    @property
    def size(self) -> int:
        """Number of peers this range names."""
        return (self.groups or 1) * self.count

    def hosts(self) -> Iterator[str]:
        """Host names, in index order (group-major)."""
        if self.groups is None:
            for i in range(self.count):
                yield f"{self.prefix}{i}"
            return
        for g in range(self.groups):
            for i in range(self.count):
                yield f"{self.prefix}{g}-{i}"

    def endpoints(self) -> Iterator[PeerEndpoint]:
        """One :class:`PeerEndpoint` per host. Built without re-validation: the field patterns
        above already make every id and address valid."""
        for h in self.hosts():
            yield PeerEndpoint.model_construct(id=h, address=f"{h}.{self.domain}:{self.port}")


class PeerTlsConfig(_Frozen):
    """Mutual TLS material (PEM files) mounted from the per-job Secret the operator creates.

    ``ca_path``: the job's CA; a peer is a member iff its certificate chains to it AND carries the
    URI SAN ``strata://job/<job id>``. ``cert_path``/``key_path``: this sidecar's certificate.
    """

    ca_path: str = os.path.join(DEFAULT_TLS_DIR, "ca.crt")
    cert_path: str = os.path.join(DEFAULT_TLS_DIR, "tls.crt")
    key_path: str = os.path.join(DEFAULT_TLS_DIR, "tls.key")


class PeersConfig(_Frozen):
    """How the sidecars of one job protect each other's RAM steps.

    ``mode``: ``replicate`` keeps ``copies`` full copies of every node's newest RAM step on other
    nodes (memory per node: ``copies`` x its own state); ``erasure`` stripes the nodes into groups
    of ``data_shards`` whose ``parity_shards`` Reed-Solomon parity blocks live on other nodes
    (memory per node ~ ``parity_shards / data_shards`` x the state; survives losing
    ``parity_shards`` nodes of a group). Erasure coding needs the members to keep the encoded step
    while the next one is written: ``ram.keep >= 2`` (checked by the sidecar).
    """

    mode: Literal["replicate", "erasure"] = "replicate"
    copies: Annotated[int, Field(ge=1, le=8)] = 1
    data_shards: Annotated[int, Field(ge=1, le=64)] = 6
    """RS k: nodes per erasure-coding group."""
    parity_shards: Annotated[int, Field(ge=1, le=16)] = 2
    """RS m: parity blocks per group, each on a node outside the group."""
    self_id: Annotated[str, Field(pattern=PEER_ID_PATTERN)] | None = None
    """This sidecar's peer id; default: the pod name, else the host name."""
    peers: tuple[PeerEndpoint, ...] = ()
    """Sidecars of the job listed one by one (tests, the demo); with ``ranges`` they make
    :attr:`members`."""
    ranges: tuple[PeerRange, ...] = ()
    """Sidecars of the job as name patterns (the webhook's form, O(1) bytes a pod)."""
    listen_host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = DEFAULT_PEER_PORT
    """TCP port of the peer server (0: any free port, tests)."""
    tls: PeerTlsConfig = PeerTlsConfig()
    bandwidth_bytes_per_second: Annotated[int, Field(ge=1024 * 1024)] | None = 256 * 1024 * 1024
    """Bound on this sidecar's peer traffic, each direction (copying in, serving out); None:
    unbounded. Training's collectives share the NIC; the default leaves most of a 25 Gb/s link."""
    poll_seconds: Annotated[float, Field(gt=0)] = 2.0
    """How often peers' inventories are polled for newly committed steps."""
    keep: Annotated[int, Field(ge=1, le=8)] = 1
    """Newest steps kept per owner (replicas) or per group (parity); older ones are deleted."""
    timeout_seconds: Annotated[float, Field(gt=0)] = 10.0

    @functools.cached_property
    def members(self) -> tuple[PeerEndpoint, ...]:
        """Every sidecar of the job, this one included: ``peers`` then each range expanded."""
        return self.peers + tuple(e for r in self.ranges for e in r.endpoints())

    @functools.cached_property
    def _by_id(self) -> dict[str, PeerEndpoint]:
        return {p.id: p for p in self.members}

    def _ids(self) -> Iterator[str]:
        yield from (p.id for p in self.peers)
        for r in self.ranges:
            yield from r.hosts()

    _checked: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _check(self) -> PeersConfig:
        # Linear in the number of peers, and it keeps nothing of the expansion (the operator
        # validates one config per workload and keeps it; only a sidecar expands `members`).
        # pydantic runs an "after" validator again each time the instance is a field value of
        # another model (every pod's StrataConfig): once per instance is enough.
        if self._checked:
            return self
        counts = Counter(self._ids())
        dup = sorted(i for i, n in counts.items() if n > 1)
        if dup:
            raise ValueError(f"peers and ranges name these ids more than once: {dup[:20]}")
        if self.self_id is not None and counts and self.self_id not in counts:
            shown = list(itertools.islice(counts, 20))
            more = f" (and {len(counts) - 20} more)" if len(counts) > 20 else ""
            raise ValueError(f"self_id {self.self_id!r} is not in peers {shown}{more}")
        self._checked = True
        return self

    def endpoint(self, peer_id: str) -> PeerEndpoint:
        """The member named ``peer_id``; raises ``KeyError`` when there is none."""
        try:
            return self._by_id[peer_id]
        except KeyError:
            raise KeyError(f"no peer {peer_id!r} in the peers list") from None


def check_peer_id(value: str) -> str:
    """Return ``value`` if it is a valid peer id (path-safe), else raise ``ValueError``."""
    if not _PEER_ID_RE.match(value) or value in (".", ".."):
        raise ValueError(f"invalid peer id {value!r}: use letters, digits, '.', '_', '-'")
    return value
