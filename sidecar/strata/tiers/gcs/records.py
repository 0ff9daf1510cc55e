"""Small records on the GCS tier: conditional create with ``if_generation_match=0``.

Of two writers exactly one creates the object (the other gets 412 and reads what is there);
an object is never replaced by this path. Uploads carry a CRC32C that GCS checks.
"""

from __future__ import annotations

from google.api_core import exceptions as gexc

from strata.errors import ShardUnavailable
from strata.tiers.gcs.client import GcsBucket


class GcsRecords(GcsBucket):
    """Mixin of :class:`strata.tiers.gcs.GcsTier`: the record methods of the Tier contract."""

    def read_record(self, key: str) -> bytes | None:
        name = self.object_name(key)
        try:
            with self._errors("reading", name, missing=ShardUnavailable):
                data: bytes = self._bucket.blob(name).download_as_bytes(
                    checksum="crc32c", retry=self._retry, timeout=self.request_timeout
                )
                return data
        except ShardUnavailable:
            return None

    def create_record(self, key: str, payload: bytes) -> bool:
        name = self.object_name(key)
        blob = self._bucket.blob(name)
        blob.metadata = self._meta("record")
        with self._errors("creating", name):
            return self.create_object(blob, payload, content_type="application/json")

    def delete_record(self, key: str) -> None:
        name = self.object_name(key)
        with self._errors("deleting", name, missing=ShardUnavailable):
            try:
                self._bucket.blob(name).delete(retry=self._retry, timeout=self.request_timeout)
            except gexc.NotFound:
                return

    def list_records(self, prefix: str) -> list[str]:
        base = self.object_name(prefix) + "/"
        with self._errors("listing", base):
            names = [
                b.name[len(base) :]
                for b in self._client.list_blobs(
                    self._bucket, prefix=base, retry=self._retry, timeout=self.request_timeout
                )
            ]
        return sorted(n for n in names if n and "/" not in n)
