"""Where copies go: pure functions of the job's peers (no I/O), deterministic on every sidecar.

Rules:

- a copy or a parity block is never on the node (Kubernetes node) of the data it protects;
- where peers carry a failure-domain label (``topology.kubernetes.io/zone``, a rack label), a full
  replica is never in its owner's domain, and erasure-coding units spread over domains as evenly
  as the ring allows;
- the load is balanced: each peer holds ``copies`` replicas; with erasure coding every peer holds
  about ``parity_shards / data_shards`` of a state in parity.

Replication uses the **ring**: the peers sorted by id. Ids are stable (pod host names), so every
sidecar computes the same holders even before it has heard from every peer, and a pod re-created on
another node keeps its place. Nodes and domains, as reported by the peers, only filter: a replica
holder is the next peer on the ring not known to share the owner's node (or, where labelled, its
domain).

**Erasure coding, declustered**: a member's *unit* (its ranks' shards laid end to end, each
aligned to the chunk size) is cut into columns of one chunk. Columns are coded on the **spread
ring** (round-robin over failure domains, within a domain over nodes: neighbours are on different
nodes and domains where possible). Column ``c`` uses the spread ring rotated by ``c``, split into
``ceil(N / data_shards)`` consecutive groups of near-equal size; each group's ``parity_shards``
parity chunks go to the next peers after it that are not on a member's node (the least-loaded
domain first). Rotating per column spreads the parity evenly over every peer, also where pods
share nodes (a fixed grouping would put whole parity blocks on the few peers outside a group). Any
``parity_shards`` lost nodes leave every group of every column at least ``k`` of its units.
The spread ring depends on the nodes the peers report; a holder encodes only when it has heard
from every peer, and every parity record names its groups, so a restore never recomputes them.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from strata.errors import StrataError


class PlacementError(StrataError, ValueError):
    """The peers cannot satisfy the placement rules; the message says what to change."""


@dataclass(frozen=True)
class PeerSite:
    """A peer as placement sees it: stable id, Kubernetes node, failure domain (both optional)."""

    id: str
    node: str | None = None
    domain: str | None = None

    @property
    def node_key(self) -> str:
        """The node, or the peer itself when the node is unknown (then assumed to be its own)."""
        return self.node if self.node else f"peer:{self.id}"


def ring(sites: Iterable[PeerSite]) -> list[PeerSite]:
    """The peers sorted by id. Raises :class:`PlacementError` on a duplicate id."""
    out = sorted(sites, key=lambda s: s.id)
    for a, b in itertools.pairwise(out):
        if a.id == b.id:
            raise PlacementError(f"peer id {a.id!r} appears twice")
    return out


def spread_ring(sites: Iterable[PeerSite]) -> list[PeerSite]:
    """The peers round-robin over failure domains (unlabelled last, as one group), within a
    domain round-robin over nodes, ids sorted: consecutive entries are on different nodes and
    domains where possible."""
    by_domain: dict[str, list[PeerSite]] = defaultdict(list)
    for s in ring(sites):
        by_domain[s.domain or "\uffff"].append(s)
    return _round_robin([_by_node(v) for _, v in sorted(by_domain.items())])


def _by_node(sites: list[PeerSite]) -> list[PeerSite]:
    by_node: dict[str, list[PeerSite]] = defaultdict(list)
    for s in sites:
        by_node[s.node_key].append(s)
    return _round_robin([v for _, v in sorted(by_node.items())])


def _round_robin(columns: list[list[PeerSite]]) -> list[PeerSite]:
    out: list[PeerSite] = []
    for i in range(max((len(c) for c in columns), default=0)):
        out.extend(c[i] for c in columns if i < len(c))
    return out


def replica_holders(sites: Sequence[PeerSite], owner: str, copies: int) -> tuple[str, ...]:
    """The ``copies`` peers that hold full copies of ``owner``'s RAM steps, in ring order.

    Never on the owner's node; when the owner has a failure domain, only peers labelled with
    another domain qualify. Raises :class:`PlacementError` when fewer than ``copies`` qualify.
    """
    if copies < 1:
        raise PlacementError(f"copies must be >= 1, got {copies}")
    order = ring(sites)
    pos = next((i for i, s in enumerate(order) if s.id == owner), None)
    if pos is None:
        raise PlacementError(f"owner {owner!r} is not one of the peers {[s.id for s in order]}")
    me = order[pos]
    chosen: list[str] = []
    for step in range(1, len(order)):
        s = order[(pos + step) % len(order)]
        if s.node_key == me.node_key:
            continue
        if me.domain and (not s.domain or s.domain == me.domain):
            continue
        chosen.append(s.id)
        if len(chosen) == copies:
            return tuple(chosen)
    where = f" outside failure domain {me.domain!r}" if me.domain else " on another node"
    raise PlacementError(
        f"{owner!r} needs {copies} replica holder(s){where} but only {len(chosen)} peer(s) "
        "qualify; lower peers.copies or spread the pods (topologySpreadConstraints)"
    )


def replicas_held_by(sites: Sequence[PeerSite], holder: str, copies: int) -> tuple[str, ...]:
    """The owners whose replicas ``holder`` keeps (inverse of :func:`replica_holders`)."""
    return tuple(
        s.id for s in sites if s.id != holder and holder in replica_holders(sites, s.id, copies)
    )


@dataclass(frozen=True)
class ColumnGroup:
    """One RS group of one column: ``members`` contribute data chunks (in this order, RS block
    numbers 0..k-1) and ``holders[i]`` keeps parity block ``k + i``."""

    members: tuple[str, ...]
    holders: tuple[str, ...]

    @property
    def k(self) -> int:
        return len(self.members)


def group_sizes(n: int, data_shards: int) -> list[int]:
    """``n`` peers split into ``ceil(n / data_shards)`` groups of near-equal size (largest first)."""
    g = max(1, math.ceil(n / data_shards))
    return [n // g + (1 if i < n % g else 0) for i in range(g)]


def check_erasure(sites: Sequence[PeerSite], data_shards: int, parity_shards: int) -> None:
    """Raise :class:`PlacementError` unless RS(``data_shards``, ``parity_shards``) fits the peers."""
    nodes = {s.node_key for s in sites}
    biggest = group_sizes(len(sites), data_shards)[0]
    if len(nodes) < biggest + parity_shards:
        raise PlacementError(
            f"RS({data_shards}, {parity_shards}) over {len(sites)} peers on {len(nodes)} nodes: "
            f"a group of {biggest} plus {parity_shards} parity holders needs "
            f"{biggest + parity_shards} distinct nodes; lower peers.data_shards or "
            "peers.parity_shards, or use mode: replicate"
        )


def column_groups(
    sites: Sequence[PeerSite], data_shards: int, parity_shards: int, column: int
) -> list[ColumnGroup]:
    """The RS groups of column ``column`` (see the module docstring). Pure and deterministic.

    Raises :class:`PlacementError` when a group cannot find ``parity_shards`` holders on nodes
    other than its members' (and each other's).
    """
    check_erasure(sites, data_shards, parity_shards)
    order = spread_ring(sites)
    n = len(order)
    shift = column % n
    rot = order[shift:] + order[:shift]
    groups: list[ColumnGroup] = []
    start = 0
    for size in group_sizes(n, data_shards):
        members = rot[start : start + size]
        used_nodes = {s.node_key for s in members}
        domains = Counter(s.domain for s in members if s.domain)
        holders: list[PeerSite] = []
        candidates = [rot[(start + size + j) % n] for j in range(n - size)]
        for _ in range(parity_shards):
            eligible = [s for s in candidates if s.node_key not in used_nodes]
            if not eligible:
                raise PlacementError(
                    f"column {column}: group {[s.id for s in members]} finds only "
                    f"{len(holders)} of {parity_shards} parity holders on other nodes; lower "
                    "peers.parity_shards or spread the pods over more nodes"
                )
            # The least-loaded domain first, ring order among equals.
            best = min(eligible, key=lambda s: domains[s.domain] if s.domain else 0)
            holders.append(best)
            used_nodes.add(best.node_key)
            if best.domain:
                domains[best.domain] += 1
            candidates.remove(best)
        groups.append(ColumnGroup(tuple(s.id for s in members), tuple(s.id for s in holders)))
        start += size
    return groups


def colocated_members(sites: Sequence[PeerSite], data_shards: int) -> list[tuple[str, ...]]:
    """Groups (of any column) with two members on one node: one node loss costs them two units
    (more pods than nodes per group); empty when erasure coding tolerates node losses fully."""
    order = spread_ring(sites)
    n = len(order)
    out = set()
    for shift in range(n):
        rot = order[shift:] + order[:shift]
        start = 0
        for size in group_sizes(n, data_shards):
            members = rot[start : start + size]
            start += size
            if len({s.node_key for s in members}) < len(members):
                out.add(tuple(sorted(s.id for s in members)))
    return sorted(out)


def group_of(groups: Sequence[ColumnGroup], member: str) -> ColumnGroup:
    for g in groups:
        if member in g.members:
            return g
    raise KeyError(f"{member!r} is in no group")
