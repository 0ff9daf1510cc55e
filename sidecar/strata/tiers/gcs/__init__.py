"""The Google Cloud Storage tier, split by job: :mod:`~strata.tiers.gcs.client` (client,
names, error translation, manifests), :mod:`~strata.tiers.gcs.errors`,
:mod:`~strata.tiers.gcs.upload` (write path), :mod:`~strata.tiers.gcs.download` (read path) and
:mod:`~strata.tiers.gcs.tier` (:class:`GcsTier`: listing, quarantine, deletion, GC; the commit
protocol is in its docstring).

Rule: like every tier, never imports the client, the restore logic or the sidecar. Importing it
imports google-cloud-storage (an optional dependency): import it lazily where GCS is optional.
"""

from strata.tiers.gcs.client import (
    MAX_COMPOSE_SOURCES,
    META_DATA_GENERATION,
    META_KIND,
    META_QUARANTINE_REASON,
    META_WORLD_SIZE,
    META_WRITER,
    PART_MARKER,
    TRANSFER_ATTEMPTS,
    crc32c_of_b64,
    make_client,
)
from strata.tiers.gcs.errors import (
    GcsBucketNotFound,
    GcsConflict,
    GcsError,
    GcsPermissionDenied,
    GcsUnreachable,
    SourceCorrupt,
    TransferCorrupt,
)
from strata.tiers.gcs.tier import GcsTier

__all__ = [
    "MAX_COMPOSE_SOURCES",
    "META_DATA_GENERATION",
    "META_KIND",
    "META_QUARANTINE_REASON",
    "META_WORLD_SIZE",
    "META_WRITER",
    "PART_MARKER",
    "TRANSFER_ATTEMPTS",
    "GcsBucketNotFound",
    "GcsConflict",
    "GcsError",
    "GcsPermissionDenied",
    "GcsTier",
    "GcsUnreachable",
    "SourceCorrupt",
    "TransferCorrupt",
    "crc32c_of_b64",
    "make_client",
]
