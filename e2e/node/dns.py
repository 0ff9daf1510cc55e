"""The cluster DNS of the real nodes, reduced to what the peer tier needs: pod host names.

The peer tier finds its peers by the stable DNS names the workload controllers give their pods
(``<hostname>.<subdomain>.<namespace>.svc``, docs/peers.md "Discovery"); in a cluster CoreDNS
answers them. The harness has no CoreDNS, so `PodDns` answers UDP queries on addresses of this
machine (the nodes' bridge gateways, port 53; the kubelets' ``clusterDNS``):

- an ``A`` query for ``<hostname>.<subdomain>.<namespace>.svc[.cluster.local]`` is answered with
  the ``status.podIP`` of the pod of the namespace whose ``spec.hostname`` and ``spec.subdomain``
  match and which is not being deleted, read from the apiserver at query time (so a replacement
  pod's new IP is served at once; TTL 1 s); other query types for such a name get an empty
  answer (NODATA);
- every other name (the search-list expansions, Service names, anything outside the cluster) is
  NXDOMAIN. Nothing is forwarded: no query ever leaves the machine.

Unlike CoreDNS the headless Service is not consulted (the name is served once the pod has an IP,
Ready or not: the peer tier's Service publishes not-ready addresses anyway).
`start()` binds every address (OSError when one is taken); `stop()` closes the sockets and joins
the thread. ``queries`` counts answered queries by name (tests assert names were looked up).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

from e2e.cluster import LocalCluster

CLUSTER_DOMAIN: Final = "cluster.local"
TYPE_A: Final = 1
CLASS_IN: Final = 1
RCODE_NXDOMAIN: Final = 3
RCODE_FORMERR: Final = 1
TTL_S: Final = 1


class DnsFormatError(ValueError):
    """A query this server cannot parse (answered with FORMERR)."""


def parse_question(packet: bytes) -> tuple[int, int, str, int, int, int]:
    """``(id, flags, name, qtype, qclass, end)`` of a query's first question; ``name`` lower
    case without the trailing dot, ``end`` the offset after the question."""
    if len(packet) < 12:
        raise DnsFormatError("shorter than a DNS header")
    qid, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount < 1:
        raise DnsFormatError("no question")
    labels: list[str] = []
    i = 12
    while True:
        if i >= len(packet):
            raise DnsFormatError("truncated name")
        n = packet[i]
        i += 1
        if n == 0:
            break
        if n & 0xC0:
            raise DnsFormatError("compressed name in a question")
        labels.append(packet[i : i + n].decode("ascii", errors="replace").lower())
        i += n
    if i + 4 > len(packet):
        raise DnsFormatError("truncated question")
    qtype, qclass = struct.unpack("!HH", packet[i : i + 4])
    return qid, flags, ".".join(labels), qtype, qclass, i + 4


def pod_name_parts(name: str, domain: str = CLUSTER_DOMAIN) -> tuple[str, str, str] | None:
    """``(hostname, subdomain, namespace)`` of ``<hostname>.<subdomain>.<namespace>.svc`` with
    or without ``.<domain>``; None for any other name."""
    suffix = "." + domain
    if name.endswith(suffix):
        name = name[: -len(suffix)]
    labels = name.split(".")
    if len(labels) != 4 or labels[3] != "svc" or not all(labels[:3]):
        return None
    return labels[0], labels[1], labels[2]


def answer(packet: bytes, end: int, qid: int, flags: int, rcode: int, ips: Sequence[str]) -> bytes:
    """The response to the query ``packet[:end]`` with ``rcode`` and one A record per IP."""
    # QR, opcode and RD of the query, AA (authoritative), no recursion available.
    out_flags = 0x8000 | (flags & 0x7900) | 0x0400 | rcode
    header = struct.pack("!HHHHHH", qid, out_flags, 1, len(ips), 0, 0)
    records = b"".join(
        struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL_S, 4) + socket.inet_aton(ip)
        for ip in ips
    )
    return header + packet[12:end] + records


class PodDns:
    """See the module docstring. ``listen_hosts``: IPv4 addresses of this machine to serve on."""

    def __init__(
        self,
        cluster: LocalCluster,
        listen_hosts: Sequence[str],
        port: int = 53,
        domain: str = CLUSTER_DOMAIN,
    ) -> None:
        self.cluster = cluster
        self.listen_hosts = tuple(listen_hosts)
        self.port = port
        self.domain = domain
        self.queries: Counter[str] = Counter()
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            for host in self.listen_hosts:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((host, self.port))
                self._socks.append(sock)
        except OSError:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._serve, name="pod-dns", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        self._socks.clear()

    def listening(self) -> bool:
        return bool(self._socks) and self._thread is not None and self._thread.is_alive()

    def pod_ips(self, hostname: str, subdomain: str, namespace: str) -> list[str]:
        """IPs of the live pods named so (at most one in a healthy workload)."""
        try:
            pods: dict[str, Any] = self.cluster.request(f"/api/v1/namespaces/{namespace}/pods")
        except OSError:
            return []
        ips: list[str] = []
        for pod in pods.get("items") or []:
            spec, status = pod.get("spec") or {}, pod.get("status") or {}
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if status.get("phase") in ("Succeeded", "Failed"):
                continue
            if spec.get("hostname") == hostname and spec.get("subdomain") == subdomain:
                ip = status.get("podIP")
                if ip:
                    ips.append(str(ip))
        return ips

    def respond(self, packet: bytes) -> bytes | None:
        """The answer to one query packet (None: not even a header to answer)."""
        try:
            qid, flags, name, qtype, qclass, end = parse_question(packet)
        except DnsFormatError:
            if len(packet) < 12:
                return None
            qid, flags = struct.unpack("!HH", packet[:4])
            return struct.pack("!HHHHHH", qid, 0x8000 | RCODE_FORMERR, 0, 0, 0, 0)
        parts = pod_name_parts(name, self.domain)
        ips = self.pod_ips(*parts) if parts is not None else []
        if not ips:
            return answer(packet, end, qid, flags, RCODE_NXDOMAIN, [])
        self.queries[name] += 1
        wanted = qtype == TYPE_A and qclass == CLASS_IN
        return answer(packet, end, qid, flags, 0, ips if wanted else [])

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        for sock in self._socks:
            sel.register(sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    ready = key.fileobj
                    if not isinstance(ready, socket.socket):
                        continue
                    try:
                        packet, peer = ready.recvfrom(4096)
                    except OSError:
                        continue
                    reply = self.respond(packet)
                    if reply is not None:
                        with contextlib.suppress(OSError):
                            ready.sendto(reply, peer)
        finally:
            sel.close()
