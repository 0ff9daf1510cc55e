"""The translation policy -> sidecar contract: a parsed ``CheckpointPolicySpec`` becomes the
:class:`strata.config.StrataConfig` that the webhook hands to the sidecar and the client.

Rule: pure (no Kubernetes calls, no kopf); it reads the API models and writes the data plane's
configuration types, and nothing else of the operator imports ``strata.config`` to build one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from strata.config import (
    DEFAULT_PVC_DIR,
    DEFAULT_RAM_DIR,
    TIER_ORDER,
    GcsTierConfig,
    Interval,
    PvcTierConfig,
    RamTierConfig,
    ReportConfig,
    RestoreConfig,
    StrataConfig,
)
from strata.peers.config import PeerRange, PeersConfig
from strata_operator.api.models import CheckpointPolicySpec, DurableTierSpec, EverySpec, PeersSpec
from strata_operator.api.validation import quantity_bytes


def to_sidecar_config(
    spec: CheckpointPolicySpec,
    job_id: str,
    *,
    policy: str | None = None,
    namespace: str | None = None,
    report_endpoint: str | None = None,
    report_ca_path: str | None = None,
    ram_path: str = DEFAULT_RAM_DIR,
    pvc_path: str = DEFAULT_PVC_DIR,
    termination_grace_seconds: float | None = None,
    peer_ranges: Sequence[Mapping[str, Any]] | None = None,
) -> StrataConfig:
    """Map a policy spec to the sidecar/client contract (:class:`strata.config.StrataConfig`).

    Pure: no Kubernetes calls. ``job_id`` is ``<namespace>.<workload>`` or the run-id annotation.
    ``ram_path``/``pvc_path`` are where the webhook mounts the tiers in the containers.
    ``termination_grace_seconds`` is the pod's effective grace period (seconds) when the caller
    knows it; otherwise the policy's ``sidecar.terminationGracePeriodSeconds``, else 30.
    Pod identity (name, uid, node) comes from the downward API at run time, not from here.

    ``peer_ranges``: the workload's pods as :class:`strata.peers.config.PeerRange` dicts
    (:func:`strata_operator.admission.peers.workload_peer_ranges`), used when the policy has
    ``spec.peers``.

    Errors: pydantic ``ValidationError`` when ``job_id`` is not a valid job id.
    """
    tiers = spec.tiers
    ram = RamTierConfig(
        path=ram_path,
        medium=tiers.ram.medium,
        size_limit_bytes=quantity_bytes(tiers.ram.size_limit),
        keep=tiers.ram.keep,
        every=Interval(steps=tiers.ram.every.steps),
    )
    pvc = None
    if tiers.pvc is not None:
        pvc = PvcTierConfig(
            path=pvc_path,
            claim_name=tiers.pvc.claim_name,
            sub_path=tiers.pvc.sub_path,
            keep=tiers.pvc.keep,
            every=_interval(tiers.pvc.every),
            components=_components(tiers.pvc),
            incremental=tiers.pvc.incremental,
        )
    gcs = None
    if tiers.gcs is not None:
        gcs = GcsTierConfig(
            bucket=tiers.gcs.bucket,
            prefix=tiers.gcs.prefix,
            keep=tiers.gcs.keep,
            every=_interval(tiers.gcs.every),
            components=_components(tiers.gcs),
            incremental=tiers.gcs.incremental,
            endpoint=tiers.gcs.endpoint,
        )
    grace = termination_grace_seconds
    if grace is None:
        grace = float(spec.sidecar.termination_grace_period_seconds or 30)
    return StrataConfig(
        job_id=job_id,
        policy=policy,
        namespace=namespace,
        ram=ram,
        pvc=pvc,
        gcs=gcs,
        restore=RestoreConfig(
            order=tuple(spec.restore.order) if spec.restore.order else tuple(TIER_ORDER),
            verify=spec.restore.verify,
            allow_fresh_start=spec.restore.allow_fresh_start,
        ),
        report=ReportConfig(endpoint=report_endpoint, ca_path=report_ca_path),
        metrics_port=spec.sidecar.ports.metrics,
        component_every=dict(spec.component_every) if spec.component_every else None,
        termination_grace_seconds=grace,
        peers=_peers_config(spec.peers, peer_ranges or ()),
    )


def _interval(every: EverySpec) -> Interval:
    return Interval(steps=every.steps, seconds=every.seconds)


def _components(tier: DurableTierSpec) -> tuple[str, ...] | None:
    return tuple(tier.components) if tier.components else None


def _peers_config(
    spec: PeersSpec | None, ranges: Sequence[Mapping[str, Any]]
) -> PeersConfig | None:
    if spec is None:
        return None
    return _cached_peers_config(
        spec.mode,
        spec.copies,
        spec.data_shards,
        spec.parity_shards,
        spec.bandwidth,
        spec.port,
        tuple((r["prefix"], r.get("groups"), r["count"], r["domain"], r["port"]) for r in ranges),
    )


@functools.lru_cache(maxsize=64)
def _cached_peers_config(
    mode: Literal["replicate", "erasure"],
    copies: int,
    data_shards: int,
    parity_shards: int,
    bandwidth: int,
    port: int,
    ranges: tuple[tuple[str, int | None, int, str, int], ...],
) -> PeersConfig:
    """One validated (frozen) :class:`PeersConfig` per policy and workload: every pod of a
    workload carries the same one, and its validation walks the ranges' host names to check
    them (O(pods)). What is kept is the ranges only (a few hundred bytes an entry: the operator
    never expands :attr:`~strata.peers.config.PeersConfig.members`)."""
    return PeersConfig(
        mode=mode,
        copies=copies,
        data_shards=data_shards,
        parity_shards=parity_shards,
        bandwidth_bytes_per_second=bandwidth,
        port=port,
        ranges=tuple(
            PeerRange(prefix=p, groups=g, count=c, domain=d, port=pt) for p, g, c, d, pt in ranges
        ),
    )
