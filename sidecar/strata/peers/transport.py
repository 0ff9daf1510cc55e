"""Mutual-TLS HTTP between the sidecars of one job: server, client, membership, bandwidth bound.

Membership (docs/peers.md, threat model): both ends present a certificate that chains to the job's
CA (the operator's per-job Secret) AND carries the URI SAN ``strata://job/<job id>``; anything
else is refused during or right after the handshake, before a request is read or sent. There is
no plain-HTTP listener and no endpoint that writes: peers only *read* each other's copies.
TLS 1.3 only. Host names are not checked (peers are addressed by pod DNS names or IPs); the job
identity in the certificate is what is checked.

Errors: :class:`PeerError` (unreachable, refused, HTTP error; the message names the peer),
:class:`NotAMember` (the other end's certificate is not of this job).
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from strata.errors import StrataError
from strata.peers.config import PeerEndpoint, PeerTlsConfig

log = logging.getLogger(__name__)


class PeerError(StrataError, RuntimeError):
    """A peer request failed; the message names the peer and the path."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotAMember(PeerError):
    """The other end's certificate does not prove membership of this job."""


def job_uri(job_id: str) -> str:
    """The URI SAN that proves membership of job ``job_id``."""
    return f"strata://job/{job_id}"


def check_member(cert: Mapping[str, Any] | None, job_id: str, who: str) -> None:
    """Raise :class:`NotAMember` unless ``cert`` (``getpeercert()``) names job ``job_id``."""
    if not cert:
        raise NotAMember(f"{who} presented no certificate")
    sans = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]
    if job_uri(job_id) not in sans:
        raise NotAMember(
            f"{who} presented a certificate for {sans or 'no job'}, not {job_uri(job_id)!r}"
        )


def tls_context(tls: PeerTlsConfig, server: bool) -> ssl.SSLContext:
    """TLS 1.3 context requiring a peer certificate signed by the job CA.

    Raises ``OSError``/``ssl.SSLError`` naming the file when the Secret is not mounted.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=tls.ca_path)
        ctx.load_cert_chain(tls.cert_path, tls.key_path)
    except (OSError, ssl.SSLError) as exc:
        raise OSError(
            f"peer TLS material unusable ({tls.ca_path}, {tls.cert_path}, {tls.key_path}): "
            f"{exc}; the webhook mounts the job's peer Secret there"
        ) from exc
    return ctx


class TokenBucket:
    """Bandwidth bound: :meth:`take` blocks until ``n`` bytes fit ``rate`` bytes/s (burst 1 s).

    ``rate`` None: unbounded. Thread-safe; shared by every transfer in one direction.
    """

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.total = 0
        """Bytes that passed (for metrics and the bench)."""
        self._tokens = float(rate or 0)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self.total += n
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


MAX_CONNECTIONS = 256
"""Concurrent connections a peer server serves (a client keeps at most 2 alive per peer; an idle
one is closed by the server after its timeout)."""


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/octet-stream"


Handler = Callable[[str, Mapping[str, str]], Reply]
"""``(path, query) -> Reply``; the request is already authenticated."""


class _RequestHandler(BaseHTTPRequestHandler):
    server: PeerServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        conn = self.request
        assert isinstance(conn, ssl.SSLSocket)
        conn.settimeout(self.server.timeout_seconds)
        conn.do_handshake()  # in this worker thread: a slow client never blocks accept()
        check_member(conn.getpeercert(), self.server.job_id, f"client {self.client_address[0]}")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            reply = self.server.handler(url.path, query)
        except Exception as exc:  # a handler bug must not kill the server thread
            log.exception("peer request %s failed", self.path)
            reply = Reply(500, f"internal error: {exc}".encode(), "text/plain")
        self.server.egress.take(len(reply.body))
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("peer %s: " + format, self.client_address[0], *args)


class PeerServer(ThreadingHTTPServer):
    """The sidecar's peer endpoint: HTTPS with client certificates of this job only.

    A connection whose certificate is missing, not signed by the job CA, or of another job is
    closed during setup (the TLS alert or a reset is all the client sees).
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        ctx: ssl.SSLContext,
        job_id: str,
        handler: Handler,
        egress: TokenBucket,
        timeout_seconds: float = 30.0,
    ) -> None:
        super().__init__(address, _RequestHandler)
        self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self.job_id = job_id
        self.handler = handler
        self.egress = egress
        self.timeout_seconds = timeout_seconds
        self.refused = 0
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Bounded: a flood of connections (authenticated or not) cannot pile up threads.
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.refused += 1
        log.warning("peer connection from %s refused or failed", client_address[0], exc_info=True)

    def serve_in_thread(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="strata-peer-server", daemon=True)
        t.start()
        return t


class PeerClient:
    """Requests to one peer over mutual TLS; every connection checks the peer's job identity."""

    def __init__(
        self,
        endpoint: PeerEndpoint,
        ctx: ssl.SSLContext,
        job_id: str,
        ingress: TokenBucket,
        timeout: float = 10.0,
    ) -> None:
        self.endpoint = endpoint
        self.ctx = ctx
        self.job_id = job_id
        self.ingress = ingress
        self.timeout = timeout
        host, _, port = endpoint.address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self._idle: list[http.client.HTTPSConnection] = []
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPSConnection:
        """A new connection whose peer certificate names this job."""
        who = f"peer {self.endpoint.id} ({self.endpoint.address})"
        conn = http.client.HTTPSConnection(
            self.host, self.port, context=self.ctx, timeout=self.timeout
        )
        try:
            conn.connect()
            assert isinstance(conn.sock, ssl.SSLSocket)
            check_member(conn.sock.getpeercert(), self.job_id, who)
        except NotAMember:
            conn.close()
            raise
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise PeerError(f"{who}: cannot connect: {exc}") from None
        return conn

    def close(self) -> None:
        """Close the idle kept-alive connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def get(self, path: str, params: Mapping[str, int] | None = None) -> bytes:
        """The body of ``GET path``; :class:`PeerError` (with ``status``) on failure.

        Connections are kept alive and reused; a reused one that turns out closed (the peer
        restarted) is replaced once."""
        if params:
            path += "?" + "&".join(f"{k}={v}" for k, v in params.items())
        who = f"peer {self.endpoint.id} ({self.endpoint.address})"
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            conn = conn or self._connect()
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if not reused:
                    raise PeerError(f"{who}: GET {path} failed: {exc}") from None
        with self._lock:
            if len(self._idle) < 2:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()
        self.ingress.take(len(body))
        if resp.status != 200:
            text = body[:500].decode(errors="replace")
            raise PeerError(f"{who}: GET {path}: HTTP {resp.status}: {text}", resp.status)
        return body

    def get_json(self, path: str) -> Any:
        raw = self.get(path)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise PeerError(f"peer {self.endpoint.id}: {path} is not JSON: {exc}") from None
