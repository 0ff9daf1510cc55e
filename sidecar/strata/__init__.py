"""Strata: multi-tier checkpointing (RAM -> PVC -> GCS) for PyTorch training on Kubernetes.

``from strata import Checkpointer`` imports torch lazily, so the operator (which never imports
torch) can import :mod:`strata.config` and :mod:`strata.reports`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata.config import ConfigError, SidecarConfig

__version__ = "0.1.0"

if TYPE_CHECKING:
    from strata.client import Checkpointer, RestoreError, RestoreResult

__all__ = [
    "Checkpointer",
    "ConfigError",
    "RestoreError",
    "RestoreResult",
    "SidecarConfig",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in ("Checkpointer", "RestoreResult", "RestoreError"):
        from strata import client

        return getattr(client, name)
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
