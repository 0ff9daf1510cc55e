"""Self-checksummed JSON records: verified on the raw bytes before any field is parsed or trusted.

A sealed record is one JSON object with two keys, in this order and spelling::

    {"crc32c":"1a2b3c4d","body":<the record's JSON>}\\n

``crc32c`` is the CRC32C (Castagnoli) of exactly the bytes of ``<the record's JSON>`` as stored,
as 8 lower-case hex digits. The envelope has a fixed-length prefix, so :func:`unseal` finds the
body by position, checks its CRC, and only then hands the body to a parser: a torn write, a
flipped bit or a hand edit is caught before pydantic sees a field. The file is still plain JSON
(``jq .body commit.json`` works).

Used by the global commit record (``commit.json``, :mod:`strata.format.commit`) and the
incarnation records (:mod:`strata.format.incarnation`); shard manifests may use the same scheme.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar, Self

import google_crc32c
from pydantic import BaseModel

from strata.errors import CommitError, FormatError

_PREFIX_RE = re.compile(rb'^\{"crc32c":"([0-9a-f]{8})","body":')
_PREFIX_LEN = len(b'{"crc32c":"00000000","body":')


def seal(body: bytes) -> bytes:
    """Wrap the JSON ``body`` (bytes of one JSON value) in a self-checksummed envelope."""
    crc = int(google_crc32c.value(body))
    return b'{"crc32c":"%08x","body":' % crc + body + b"}\n"


def seal_parts(parts: Sequence[bytes]) -> bytes:
    """``seal(b"".join(parts))`` with one copy of the bytes instead of three (the CRC32C is
    extended part by part; a 10,000-tensor manifest is ~1.6 MB)."""
    crc = 0
    for part in parts:
        crc = google_crc32c.extend(crc, part)
    return b"".join((b'{"crc32c":"%08x","body":' % crc, *parts, b"}\n"))


def unseal(raw: bytes, where: str) -> bytes:
    """The verified body bytes of a sealed record.

    Raises :class:`FormatError` naming ``where`` (a path or object name) when ``raw`` is not a
    sealed record or its checksum does not match (a torn or corrupted copy: quarantine it and use
    another copy, or rewrite it from the shards it describes).
    """
    m = _PREFIX_RE.match(raw)
    end = raw.rstrip(b"\n")
    if m is None or not end.endswith(b"}") or len(end) < _PREFIX_LEN + 1:
        raise FormatError(
            f"{where} is not a sealed Strata record (expected "
            '{"crc32c":"<8 hex>","body":...}); it is torn or was written by something else'
        )
    body = end[_PREFIX_LEN:-1]
    want = int(m.group(1), 16)
    got = int(google_crc32c.value(body))
    if got != want:
        raise FormatError(
            f"{where}: checksum mismatch (recorded crc32c {want:08x}, bytes give {got:08x}); "
            "the record is corrupt"
        )
    return body


class SealedRecord(BaseModel):
    """A pydantic record stored sealed: :meth:`to_bytes` / :meth:`from_bytes` (the commit record
    and the incarnation records). ``record_kind`` names the record in error messages."""

    record_kind: ClassVar[str] = "record"

    def to_bytes(self) -> bytes:
        """The sealed record as stored."""
        return seal(self.model_dump_json().encode())

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> Self:
        """Verify the seal, then parse. Raises :class:`strata.errors.CommitError` naming
        ``where`` on a torn, corrupt or malformed record."""
        try:
            body = unseal(raw, where)
        except ValueError as exc:
            raise CommitError(str(exc)) from None
        try:
            return cls.model_validate_json(body)
        except ValueError as exc:
            raise CommitError(f"malformed {cls.record_kind} {where}: {exc}") from None
