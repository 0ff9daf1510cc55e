"""Errors of the GCS tier: what a failed call means for the caller (all are TierErrors).

:class:`GcsUnreachable`, :class:`GcsPermissionDenied`, :class:`GcsBucketNotFound`: the tier is
unusable; restore falls back to the next tier, promotion retries later. :class:`GcsConflict`:
another writer holds the object. :class:`SourceCorrupt`: quarantine the *source* of an upload.
:class:`TransferCorrupt`: bytes arrived damaged although the stored copy is fine (fall back,
never quarantine). The underscore-free internal signals at the end never leave the package.
"""

from __future__ import annotations

from strata.errors import ShardCorrupt, ShardUnavailable, StrataError, TierError


class GcsError(TierError):
    """A GCS call failed; the message names ``gs://bucket/object`` and what to do."""


class GcsBucketNotFound(GcsError):
    """The bucket does not exist (404 on a bucket-level or upload call)."""


class GcsPermissionDenied(GcsError):
    """401/403 or no usable credentials."""


class GcsUnreachable(GcsError):
    """The endpoint did not answer (connection errors, timeouts, 5xx) after retrying."""


class GcsConflict(GcsError):
    """An object Strata would create exists with other content: another writer holds it."""


class SourceCorrupt(ShardCorrupt):
    """``put_shard``'s source file does not match its manifest; nothing was committed."""


class TransferCorrupt(ShardUnavailable, GcsError):
    """Bytes kept arriving damaged although the stored object verifies server-side.

    A :class:`ShardUnavailable` (fall back to another tier), deliberately not a
    :class:`ShardCorrupt`: the stored copy is fine and must not be quarantined.
    """


class AlreadyExists(StrataError):
    """Internal: a create-only call got 412 (the object exists)."""


class Aborted(StrataError):
    """Internal: another range of the same download failed; stop this one."""


class TransitMismatch(StrataError):
    """Internal: a downloaded range did not match the manifest's chunk CRC32Cs."""
