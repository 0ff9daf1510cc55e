"""Peer placement (issue 16): replicas never on the owner's node or failure domain, erasure-coding
groups whose units are on distinct nodes, tolerate any m losses, and spread parity evenly."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest

from strata.peers.erasure import decode, encode_parity
from strata.peers.placement import (
    PeerSite,
    PlacementError,
    colocated_members,
    column_groups,
    replica_holders,
    replicas_held_by,
    ring,
    spread_ring,
)
from strata.peers.wire import Segment, locate, unit_columns

pytestmark = pytest.mark.unit


def sites(n: int, per_node: int = 1, domains: int = 0) -> list[PeerSite]:
    return [
        PeerSite(
            f"p{i:02d}",
            node=f"n{i // per_node}",
            domain=f"z{(i // per_node) % domains}" if domains else None,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("n", "per_node", "domains", "copies"),
    [(4, 1, 0, 1), (8, 2, 0, 2), (9, 1, 3, 2), (12, 2, 3, 1)],
)
def test_replica_holders_avoid_owner_node_and_domain_and_balance(
    n: int, per_node: int, domains: int, copies: int
) -> None:
    peers = sites(n, per_node, domains)
    by_id = {s.id: s for s in peers}
    load: Counter[str] = Counter()
    for owner in peers:
        holders = replica_holders(peers, owner.id, copies)
        assert len(set(holders)) == copies
        for h in holders:
            assert by_id[h].node != owner.node
            if domains:
                assert by_id[h].domain != owner.domain
            load[h] += 1
    assert max(load.values()) <= copies + 1
    for s in peers:
        assert set(replicas_held_by(peers, s.id, copies)) == {
            o.id for o in peers if s.id in replica_holders(peers, o.id, copies)
        }


def test_replica_placement_refuses_when_only_the_same_domain_is_left() -> None:
    peers = [PeerSite("a", "n1", "z1"), PeerSite("b", "n2", "z1"), PeerSite("c", "n3", "z2")]
    assert replica_holders(peers, "a", 1) == ("c",)
    with pytest.raises(PlacementError, match=r"outside failure domain 'z1'.*lower peers\.copies"):
        replica_holders(peers, "a", 2)
    with pytest.raises(PlacementError, match="on another node"):
        replica_holders([PeerSite("a", "n1"), PeerSite("b", "n1")], "a", 1)


def test_spread_ring_alternates_nodes_and_domains() -> None:
    order = spread_ring(sites(8, per_node=2, domains=2))
    for a, b in itertools.pairwise(order):
        assert a.node != b.node
        assert a.domain != b.domain


def test_replica_placement_does_not_move_when_nodes_become_known_or_change() -> None:
    """Replica holders are keyed on stable ids: learning the peers' nodes (all distinct) or a pod
    re-created on another node changes nothing, so no copy is made twice."""
    unknown = [PeerSite(f"w{i}") for i in range(5)]
    known = [PeerSite(f"w{i}", node=f"node-{(7 * i) % 5}") for i in range(5)]
    moved = [*known[:2], PeerSite("w2", node="node-new"), *known[3:]]
    for owner in ("w0", "w2", "w4"):
        assert (
            replica_holders(unknown, owner, 2)
            == replica_holders(known, owner, 2)
            == replica_holders(moved, owner, 2)
        )
    assert [s.id for s in ring(reversed(known))] == [f"w{i}" for i in range(5)]


def test_colocated_group_members_are_reported() -> None:
    assert colocated_members(sites(8, per_node=2), 3) == []
    # Six pods on two nodes: a group of three cannot avoid sharing a node.
    assert colocated_members(sites(6, per_node=3), 3)


@pytest.mark.parametrize(
    ("n", "per_node", "k", "m"),
    [(4, 1, 2, 1), (8, 1, 6, 2), (12, 1, 6, 2), (8, 2, 3, 1), (7, 1, 3, 2), (16, 2, 6, 2)],
)
def test_column_groups_tolerate_any_m_lost_nodes_and_spread_parity(
    n: int, per_node: int, k: int, m: int
) -> None:
    peers = sites(n, per_node)
    node = {s.id: s.node_key for s in peers}
    parity_load: Counter[str] = Counter()
    for c in range(n):
        groups = column_groups(peers, k, m, c)
        members = [p for g in groups for p in g.members]
        assert sorted(members) == sorted(s.id for s in peers)
        for g in groups:
            assert len(g.holders) == m
            assert not set(g.holders) & set(g.members)
            member_nodes = {node[p] for p in g.members}
            assert not {node[h] for h in g.holders} & member_nodes
            assert len({node[h] for h in g.holders}) == m
            parity_load.update(g.holders)
        # Any m lost nodes leave every group at least k of its k + m units.
        for lost_nodes in itertools.combinations(sorted(set(node.values())), m):
            for g in groups:
                units = list(g.members) + list(g.holders)
                left = sum(1 for p in units if node[p] not in lost_nodes)
                assert left >= g.k
    # Over N columns every peer holds the same number of parity chunks (the rotation).
    assert len(parity_load) == n
    assert max(parity_load.values()) - min(parity_load.values()) <= 1


def test_erasure_too_few_nodes_is_a_clear_error() -> None:
    with pytest.raises(PlacementError, match=r"RS\(6, 2\).*lower peers.data_shards"):
        column_groups(sites(4), 6, 2, 0)


@pytest.mark.parametrize(("k", "m"), [(2, 1), (6, 2), (4, 3)])
def test_reed_solomon_rebuilds_any_k_of_k_plus_m(k: int, m: int) -> None:
    data = [os.urandom(4096) for _ in range(k)]
    parity = encode_parity(data, m, list(range(m)))
    blocks = dict(enumerate(data + parity))
    for kept in itertools.combinations(range(k + m), k):
        assert decode({i: blocks[i] for i in kept}, k, m) == data
    with pytest.raises(ValueError, match="needs"):
        decode({0: data[0]}, k, m)


def test_unit_layout_aligns_ranks_to_chunks() -> None:
    unit = [Segment(rank=3, offset=0, nbytes=100), Segment(rank=5, offset=128, nbytes=130)]
    assert unit_columns(unit, 64) == 5
    assert locate(unit, 0, 64) == (3, 0, 64)
    assert locate(unit, 1, 64) == (3, 64, 36)
    assert locate(unit, 2, 64) == (5, 0, 64)
    assert locate(unit, 4, 64) == (5, 128, 2)
    assert locate(unit, 5, 64) is None
