"""Storage tiers: one contract (:mod:`~strata.tiers.base`), one module or package per medium:
:mod:`~strata.tiers.posix` (PVC), :mod:`~strata.tiers.ram` with its slot ring
(:mod:`~strata.tiers.slots`), :mod:`~strata.tiers.gcs`.

Rule: tiers move and verify bytes in the :mod:`strata.format` layout; they never import
:mod:`strata.restore`, the client or the sidecar (callers decide what to do with a tier's
errors: fall back, quarantine, retry).
"""
