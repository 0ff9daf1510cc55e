"""The tiers a :class:`strata.config.StrataConfig` configures, built the same way for the trainer
(restore without a sidecar) and for the sidecar (promotion, staging)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from strata.config import StrataConfig, TierName
from strata.errors import TierError
from strata.tiers.base import Tier
from strata.tiers.posix import PosixTier
from strata.tiers.ram import RamTier


def durable_tiers(
    config: StrataConfig,
    *,
    writer_id: str,
    gcs_retry_timeout: float = 120.0,
    on_gcs_error: Callable[[Exception], None] | None = None,
) -> dict[TierName, Tier]:
    """The PVC and GCS tiers of ``config`` that are configured, fastest first.

    GCS is imported lazily (google-cloud-storage is optional). ``writer_id`` is stamped on what
    GCS writes; ``gcs_retry_timeout``: seconds a retried GCS call may take. When the GCS tier
    cannot be built (no client library, no credentials: :class:`ImportError` or
    :class:`TierError`), ``on_gcs_error`` receives the error and GCS is left out; without it the
    error propagates.
    """
    out: dict[TierName, Tier] = {}
    if config.pvc is not None:
        out["pvc"] = PosixTier(config.pvc.path, "pvc")
    if config.gcs is not None:
        try:
            from strata.tiers.gcs import GcsTier

            out["gcs"] = GcsTier(config.gcs, writer_id=writer_id, retry_timeout=gcs_retry_timeout)
        except (TierError, ImportError) as exc:
            if on_gcs_error is None:
                raise
            on_gcs_error(exc)
    return out


def in_restore_order(
    config: StrataConfig,
    ram: RamTier,
    durable: Mapping[TierName, Tier],
    peer: Tier | None = None,
) -> list[Tier]:
    """RAM, the peer tier (when given: only the sidecar holds the peers' TLS material) and the
    durable tiers in restore order (:meth:`StrataConfig.tiers_in_restore_order`)."""
    by_name: dict[str, Tier] = {"ram": ram, **{str(k): t for k, t in durable.items()}}
    if peer is not None:
        by_name["peer"] = peer
    return [by_name[t] for t in config.tiers_in_restore_order() if t in by_name]
