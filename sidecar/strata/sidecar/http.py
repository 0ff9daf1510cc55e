"""Small JSON-over-HTTP plumbing on a unix socket (the trainer's local API) and on TCP (metrics).

The local API lives on a unix socket inside the RAM volume, so only containers that mount that
volume (the trainer) can reach it and nothing is exposed on the network. Request and response
bodies are JSON objects; errors are ``{"error": "...", "kind": "..."}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from strata.errors import StrataError

log = logging.getLogger("strata.sidecar.http")

JsonHandler = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]
"""(request body or query as a dict) -> (HTTP status, response object)."""
BytesHandler = Callable[[dict[str, Any]], bytes]
"""(request body or query as a dict) -> the reply's bytes (200, ``application/octet-stream``,
with its ``Content-Length``); errors as :class:`ApiError` (a JSON error reply)."""


class ApiError(StrataError):
    """Raised by a handler: becomes ``{"error": message, "kind": kind}`` with ``status``."""

    def __init__(
        self, status: int, kind: str, message: str, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.extra = extra or {}


class Routes:
    def __init__(self) -> None:
        self.json: dict[tuple[str, str], JsonHandler] = {}
        self.raw: dict[tuple[str, str], Callable[[], tuple[int, str, bytes]]] = {}
        self.bytes: dict[tuple[str, str], BytesHandler] = {}

    def add(self, method: str, path: str, handler: JsonHandler) -> None:
        self.json[(method, path)] = handler

    def add_raw(
        self, method: str, path: str, handler: Callable[[], tuple[int, str, bytes]]
    ) -> None:
        self.raw[(method, path)] = handler

    def add_bytes(self, method: str, path: str, handler: BytesHandler) -> None:
        """A route whose request is JSON and whose reply is raw bytes (:data:`BytesHandler`)."""
        self.bytes[(method, path)] = handler


def _make_handler(routes: Routes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "strata-sidecar"

        def address_string(self) -> str:  # AF_UNIX peers have no (host, port)
            return str(self.client_address[0]) if self.client_address else "unix"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            raw = routes.raw.get((method, url.path))
            if raw is not None:
                status, ctype, body = raw()
                self._send(status, ctype, body)
                return
            handler = routes.json.get((method, url.path))
            as_bytes = routes.bytes.get((method, url.path))
            reply_bytes: bytes | None = None
            if handler is None and as_bytes is None:
                self._send_json(
                    404, {"error": f"no endpoint {method} {url.path}", "kind": "not_found"}
                )
                return
            try:
                if method == "GET":
                    request: dict[str, Any] = {k: v[-1] for k, v in parse_qs(url.query).items()}
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else b"{}"
                    request = json.loads(body or b"{}")
                    if not isinstance(request, dict):
                        raise ApiError(400, "bad_request", "the request body must be a JSON object")
                if as_bytes is not None:
                    reply_bytes = as_bytes(request)
                else:
                    assert handler is not None
                    status, response = handler(request)
            except ApiError as exc:
                status = exc.status
                response = {"error": str(exc), "kind": exc.kind, **exc.extra}
            except json.JSONDecodeError as exc:
                status, response = (
                    400,
                    {"error": f"request body is not JSON: {exc}", "kind": "bad_request"},
                )
            except Exception as exc:
                log.exception("local API %s %s failed", method, url.path)
                status, response = (
                    500,
                    {"error": f"{type(exc).__name__}: {exc}", "kind": "internal"},
                )
            if reply_bytes is not None:
                self._send(200, "application/octet-stream", reply_bytes)
                return
            self._send_json(status, response)

        def _send_json(self, status: int, obj: dict[str, Any]) -> None:
            self._send(status, "application/json", json.dumps(obj).encode())

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

    return Handler


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128
    """listen() backlog: every rank of a pod may call at once (socketserver's default of 5 made
    a connect fail with EAGAIN while the sidecar was busy)."""


def serve_unix(path: Path, routes: Routes) -> UnixHTTPServer:
    """Serve ``routes`` on a unix socket at ``path`` (a stale socket file is replaced), 0660."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket() or path.exists():
        path.unlink()
    server = UnixHTTPServer(str(path), _make_handler(routes))
    os.chmod(path, 0o660)
    threading.Thread(target=server.serve_forever, name="strata-local-api", daemon=True).start()
    return server


def serve_tcp(host: str, port: int, routes: Routes) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _make_handler(routes))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="strata-metrics", daemon=True).start()
    return server
