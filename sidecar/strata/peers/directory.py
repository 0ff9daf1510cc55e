"""The other sidecars of the job: one mutual-TLS client each, their inventories, their sites."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

from pydantic import ValidationError

from strata.peers.config import PeersConfig
from strata.peers.placement import PeerSite
from strata.peers.transport import PeerClient, PeerError, TokenBucket
from strata.peers.wire import ParityRecord, PeerInventory

log = logging.getLogger(__name__)


class PeerDirectory:
    """Clients for every peer but ``self_id``; inventories fetched in parallel, failures noted.

    ``ingress``: the bandwidth bound shared by every copy this sidecar pulls.
    """

    def __init__(
        self,
        config: PeersConfig,
        job_id: str,
        self_id: str,
        ctx: ssl.SSLContext,
        ingress: TokenBucket,
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.self_id = self_id
        self.clients = {
            p.id: PeerClient(p, ctx, job_id, ingress, timeout=config.timeout_seconds)
            for p in config.members
            if p.id != self_id
        }
        self._known: dict[str, PeerInventory] = {}
        self._records: dict[tuple[str, int], ParityRecord] = {}

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def client(self, peer: str) -> PeerClient:
        try:
            return self.clients[peer]
        except KeyError:
            raise PeerError(f"{peer!r} is not a peer of this sidecar") from None

    def inventory(self, peer: str) -> PeerInventory:
        raw = self.client(peer).get_json("/v1/inventory")
        try:
            inv = PeerInventory.model_validate(raw)
        except ValidationError as exc:
            raise PeerError(f"peer {peer}: malformed inventory: {exc}") from None
        if inv.job_id != self.job_id or inv.peer != peer:
            raise PeerError(
                f"peer {peer}: inventory of {inv.peer!r} of job {inv.job_id!r}, not {peer!r} of "
                f"{self.job_id!r}; check the peers list"
            )
        return inv

    def inventories(
        self, only: Collection[str] | None = None
    ) -> tuple[dict[str, PeerInventory], list[str]]:
        """Every reachable peer's inventory (or only those of ``only``), and a note per
        unreachable one."""
        wanted = [p for p in self.clients if only is None or p in only]
        if not wanted:
            return {}, []
        notes: list[str] = []
        out: dict[str, PeerInventory] = {}
        with ThreadPoolExecutor(max_workers=min(16, len(wanted))) as pool:
            futures = {pid: pool.submit(self.inventory, pid) for pid in wanted}
            for pid, fut in futures.items():
                try:
                    out[pid] = fut.result()
                except PeerError as exc:
                    notes.append(str(exc))
        self._known.update(out)
        return out, notes

    def sites(self, me: PeerSite) -> list[PeerSite]:
        """Every peer of the configuration as placement sees it: node and domain from its last
        inventory, else from the configuration (an unknown node counts as its own)."""
        out = []
        for p in self.config.members:
            if p.id == me.id:
                out.append(me)
                continue
            inv = self._known.get(p.id)
            node = (inv.node if inv else None) or p.node
            domain = (inv.domain if inv else None) or p.domain
            out.append(PeerSite(p.id, node, domain))
        return out

    def parity_record(self, holder: str, step: int) -> ParityRecord:
        """A holder's parity record of ``step`` (cached: a committed record never changes)."""
        key = (holder, step)
        if key not in self._records:
            raw = self.client(holder).get(f"/v1/parity/{step}/record")
            try:
                rec = ParityRecord.model_validate_json(raw)
            except ValidationError as exc:
                raise PeerError(f"peer {holder}: malformed parity record: {exc}") from None
            if rec.job_id != self.job_id or rec.holder != holder or rec.step != step:
                raise PeerError(f"peer {holder}: parity record of another job, holder or step")
            if len(self._records) > 256:
                self._records.clear()
            self._records[key] = rec
        return self._records[key]
