"""Peer tier: RAM-tier copies on other nodes, by replication or erasure coding.

A node's RAM tier dies with the node. The sidecars of one job therefore keep what they need to
rebuild each other's newest RAM steps in each other's RAM, so a replacement pod restores the
RAM-interval step from its peers instead of falling back to the PVC (RPO: one RAM interval
instead of one PVC interval). See docs/peers.md for the design and the threat model.

Modules (each one responsibility):

- :mod:`strata.peers.config`     ``PeersConfig``: mode, copies / RS(k, m), peers, TLS, bandwidth.
- :mod:`strata.peers.placement`  pure: who holds whose copies, erasure-coding groups.
- :mod:`strata.peers.erasure`    Reed-Solomon over GF(2^8) (zfec, imported lazily).
- :mod:`strata.peers.store`      replica and parity files in the local RAM directory.
- :mod:`strata.peers.wire`       the JSON models peers exchange (inventory, parity record).
- :mod:`strata.peers.transport`  mutual-TLS HTTP server and client, bandwidth bound.
- :mod:`strata.peers.service`    the sidecar's peer server and background copy/encode rounds.
- :mod:`strata.peers.tier`       ``PeerTier``: restore from peers (copies, or rebuild).

Every transfer is a *pull* over mutual TLS: a sidecar copies from its peers what placement says
it holds; no endpoint writes into another node's RAM.
"""
