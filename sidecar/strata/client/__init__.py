"""The training client: :class:`Checkpointer` (orchestration), its save path and the sidecar's
client side.

Rule: this package never imports :mod:`strata.sidecar` (the sidecar is another process; the
client speaks to it only through :mod:`strata.protocol` over the unix socket) and never imports
kopf or the operator. :mod:`~strata.client.checkpointer` and :mod:`~strata.client.saver` import
torch; :mod:`~strata.client.sidecar_client` does not (the sidecar image has no torch), so the
names below are imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata.errors import RestoreError

if TYPE_CHECKING:
    from strata.client.checkpointer import Checkpointer, RestoreResult
    from strata.client.stager import LocalStager, Stager

__all__ = ["Checkpointer", "LocalStager", "RestoreError", "RestoreResult", "Stager"]


def __getattr__(name: str) -> Any:
    if name in ("LocalStager", "Stager"):
        from strata.client import stager

        return getattr(stager, name)
    if name in ("Checkpointer", "RestoreResult"):
        from strata.client import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'strata.client' has no attribute {name!r}")
