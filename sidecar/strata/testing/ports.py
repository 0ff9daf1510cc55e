"""Free TCP ports for tests, benchmarks and the demo (the one definition every harness uses)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the kernel's choice; another process may take it
    before the caller binds it, so callers that can bind port 0 themselves should)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
