"""Every error a Strata user can meet, by what the caller should do about it.

``StrataError`` is the root; catch it to catch anything Strata raises on purpose. Families:

- :class:`ConfigError` (also a ``ValueError``): a setting is missing, invalid or conflicting
  (:class:`PolicyError`). Fix the configuration; retrying does not help.
- :class:`TierError` (also a ``RuntimeError``): a storage tier failed. Restore and promotion
  **fall back to the next tier** on :class:`ShardUnavailable`; :class:`ShardCorrupt` (a
  ``ShardUnavailable``) additionally means **quarantine that copy** so it is never served again.
  :class:`TierFull` and :class:`SlotsBusy` are back-pressure: the save is refused and the
  previous committed step is intact. :class:`StageError`: no tier served a shard; re-plan the
  restore without that step.
- :class:`ProtocolError` (a ``TierError``): the sidecar's local API did not answer or answered
  something unexpected; the trainer treats the sidecar like an unreachable tier.
- :class:`RestoreError` (a ``RuntimeError``): **restore is impossible**: no step is restorable
  on every rank and fresh starts are not allowed. Only a person can decide (allow a fresh start,
  bring a tier back).
- :class:`FormatError` (also a ``ValueError``): bytes or a state tree do not fit the checkpoint
  format: :class:`ManifestError` (a malformed manifest; tiers turn it into ``ShardCorrupt``)
  and :class:`CodecError` (a checkpoint that does not fit the live state, a value the codec
  cannot store; the message names the path in the state tree).

Tier-specific subclasses live with their tier (e.g. :mod:`strata.tiers.gcs.errors`) and are
exported from :mod:`strata` too.
"""

from __future__ import annotations


class StrataError(Exception):
    """Root of every error Strata raises on purpose; the message says what to do."""


class ConfigError(StrataError, ValueError):
    """A setting is missing or invalid; the message names the setting and what to do."""


class PolicyError(ConfigError):
    """Conflicting or invalid policy options; the message names them."""


class TierError(StrataError, RuntimeError):
    """A tier operation failed; the message names the object and what to do."""


class ShardUnavailable(TierError):
    """The shard is not committed in this tier (missing, partial, or quarantined): fall back
    to the next tier."""


class ShardCorrupt(ShardUnavailable):
    """A committed shard failed verification (checksum, length, manifest identity): quarantine
    that copy, then fall back to the next tier."""


class TierFull(TierError):
    """No space left (ENOSPC / quota); the previous committed step is untouched."""


class SlotsBusy(TierError):
    """Every slot of the rank is committed (within ``keep``) or leased and the ring is at its
    maximum size; the save is refused (back-pressure) and the previous steps stay intact."""


class StageError(ShardUnavailable):
    """No tier could serve the shard; re-plan without this step. ``skipped`` says why, per tier;
    ``quarantined`` names the tiers whose copy failed verification on the way."""

    def __init__(
        self, message: str, skipped: list[str], quarantined: list[str] | None = None
    ) -> None:
        super().__init__(message)
        self.skipped = skipped
        self.quarantined = list(quarantined or [])


class ProtocolError(TierError):
    """The sidecar's local API failed: no answer on the socket, or an answer that is not the
    expected message. The trainer treats it like an unreachable tier."""


class SidecarUnavailable(ProtocolError):
    """The sidecar did not answer on its socket."""


class RestoreError(StrataError, RuntimeError):
    """No restorable step and fresh starts are not allowed; the message lists what was searched."""


class FormatError(StrataError, ValueError):
    """Bytes or a state tree do not fit the checkpoint format."""


class ManifestError(FormatError):
    """A manifest is missing, malformed, of another job/world size or an unknown version."""


class CommitError(FormatError):
    """A global commit record (``commit.json``) or incarnation record is malformed, fails its
    self-checksum, or does not describe the shards it sits next to; or a step cannot be committed
    because its shards are not one incarnation's complete set (the message says which)."""


class CodecError(FormatError):
    """Saved data does not fit the manifest or the live state (names the path and the fix)."""


class StateChanged(StrataError, RuntimeError):
    """A tensor of the state changed in place while an overlapped save was copying it
    (``save(..., blocking=False)``); that step is not committed, the previous one is intact.
    Call ``wait_copied()`` before changing the state (optimizers in the state do it by
    themselves)."""
