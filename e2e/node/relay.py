"""A TCP relay from an address pods can reach to the local apiserver on loopback.

The local control plane (`e2e.cluster.LocalCluster`) listens on 127.0.0.1 only, and the real
node has no kube-proxy, so a pod's ``kubernetes`` ClusterIP Service leads nowhere. `TcpRelay`
listens on the node's bridge gateway (an address of this machine only, on the bridge the harness
made) and copies bytes both ways to the apiserver's loopback port: TLS stays end to end between
the pod and the apiserver, whose serving certificate names the gateway
(``LocalCluster(extra_serving_ips=...)``). An operator pod then reaches the apiserver through
``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` set to the relay (`e2e.node.stack`).

`start()` binds and returns the port; `stop()` closes the listener and every relayed connection
and joins the threads: nothing is left listening.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Final

_CHUNK: Final = 65536


class TcpRelay:
    """Relay connections accepted on ``(listen_host, listen_port)`` (0: any free port) to
    ``(target_host, target_port)``."""

    def __init__(
        self, listen_host: str, target_host: str, target_port: int, listen_port: int = 0
    ) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target = (target_host, target_port)
        self.connections = 0
        """Connections accepted so far."""
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> int:
        """Bind and start accepting; returns the port listened on."""
        self._server = socket.create_server((self.listen_host, self.listen_port))
        self.listen_port = self._server.getsockname()[1]
        t = threading.Thread(target=self._accept_loop, name="tcp-relay", daemon=True)
        t.start()
        self._threads.append(t)
        return self.listen_port

    def _accept_loop(self) -> None:
        assert self._server is not None
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                if not sel.select(timeout=0.5):
                    continue
                try:
                    client, _ = self._server.accept()
                except OSError:
                    continue
                try:
                    upstream = socket.create_connection(self.target, timeout=10)
                except OSError:
                    client.close()
                    continue
                upstream.settimeout(None)
                self.connections += 1
                with self._lock:
                    self._open.update((client, upstream))
                done = [0]  # pumps of this connection finished; the second closes both sockets
                for src, dst in ((client, upstream), (upstream, client)):
                    t = threading.Thread(
                        target=self._pump, args=(src, dst, client, upstream, done), daemon=True
                    )
                    t.start()
                    with self._lock:
                        self._threads = [x for x in self._threads if x.is_alive()]
                        self._threads.append(t)
        finally:
            sel.close()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        client: socket.socket,
        upstream: socket.socket,
        done: list[int],
    ) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        # Half-close: the other direction may still carry the peer's last bytes.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            done[0] += 1
            last = done[0] == 2
            if last:
                self._open.discard(client)
                self._open.discard(upstream)
        if last:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()

    def stop(self) -> None:
        """Stop accepting, close every relayed connection and join the threads."""
        self._stop.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.close()
        with self._lock:
            socks = list(self._open)
            self._open.clear()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)
