"""Strata: multi-tier checkpointing (RAM -> PVC -> GCS) for PyTorch training on Kubernetes.

The public API: :class:`Checkpointer` and :class:`RestoreResult` (the training client),
:class:`StrataConfig` (the one configuration of the trainer and its sidecar), and every error a
user can meet (:mod:`strata.errors` explains the families; GCS-specific ones come from
:mod:`strata.tiers.gcs.errors`).

``from strata import Checkpointer`` imports torch lazily, so the operator (which never imports
torch) can import :mod:`strata.config` and :mod:`strata.reports`; the GCS errors are imported
lazily too (google-cloud-storage is optional).

Package map (each package's docstring states its rule): :mod:`strata.format` (layout, manifest,
codec, checksums; no I/O), :mod:`strata.tiers` (the storage contract and its media),
:mod:`strata.restore` (planning and staging), :mod:`strata.client` (the trainer's side),
:mod:`strata.protocol` (trainer <-> sidecar messages), :mod:`strata.sidecar` (the sidecar
process), :mod:`strata.testing` (emulator and demo support).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata.config import StrataConfig
from strata.errors import (
    CodecError,
    CommitError,
    ConfigError,
    FormatError,
    ManifestError,
    PolicyError,
    ProtocolError,
    RestoreError,
    ShardCorrupt,
    ShardUnavailable,
    SidecarUnavailable,
    SlotsBusy,
    StageError,
    StateChanged,
    StrataError,
    TierError,
    TierFull,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from strata.client import Checkpointer, RestoreResult
    from strata.tiers.gcs.errors import (
        GcsBucketNotFound,
        GcsConflict,
        GcsError,
        GcsPermissionDenied,
        GcsUnreachable,
    )

_LAZY = {
    "Checkpointer": "strata.client",
    "RestoreResult": "strata.client",
    "GcsError": "strata.tiers.gcs.errors",
    "GcsBucketNotFound": "strata.tiers.gcs.errors",
    "GcsPermissionDenied": "strata.tiers.gcs.errors",
    "GcsUnreachable": "strata.tiers.gcs.errors",
    "GcsConflict": "strata.tiers.gcs.errors",
}

__all__ = [
    "Checkpointer",
    "CodecError",
    "CommitError",
    "ConfigError",
    "FormatError",
    "GcsBucketNotFound",
    "GcsConflict",
    "GcsError",
    "GcsPermissionDenied",
    "GcsUnreachable",
    "ManifestError",
    "PolicyError",
    "ProtocolError",
    "RestoreError",
    "RestoreResult",
    "ShardCorrupt",
    "ShardUnavailable",
    "SidecarUnavailable",
    "SlotsBusy",
    "StageError",
    "StateChanged",
    "StrataConfig",
    "StrataError",
    "TierError",
    "TierFull",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'strata' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
