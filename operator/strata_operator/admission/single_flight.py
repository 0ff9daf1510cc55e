"""A short-lived cache of API answers that makes one request per key at a time (single flight).

Why: a burst of pods of one job asks the apiserver the same questions (the pod's JobSet, "does the
job's peer Secret exist") once per pod. Through the default executor (6 threads on a 2-core node)
a 512-pod burst queued two API calls per pod, and the admissions at the back of the queue ran into
the webhook's timeout. With this cache the first admission of a key asks, the admissions arriving
meanwhile wait for that same answer, and the ones after it reuse the answer for ``ttl`` seconds.
With ``refresh_in_background``, an answer past its ``ttl`` (still ``fresh``) is served once more
while one request renews it, so that a steady stream of admissions never waits for a renewal; a
renewal that fails drops the answer (the next caller asks and sees the failure).

Rules: a failure is never cached (every waiter of the failed request sees the failure, the next
call asks again); a value the caller finds stale (``fresh`` returns False, e.g. another uid than
the pod names) is fetched again; at most ``max_entries`` keys are kept (least recently used
dropped); :meth:`SingleFlightCache.invalidate` forgets one key. The fetch runs as its own task, so
that an admission cancelled while it waits (its client went away) does not cancel the request the
other waiters share. Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

log = logging.getLogger("strata.webhook")


class SingleFlightCache(Generic[K, V]):
    """Values by key, each kept ``ttl`` seconds (monotonic clock; 0: only concurrent callers
    share a request), at most ``max_entries`` keys; ``refresh_in_background``: see the module
    docstring.

    Raises ``ValueError`` for a negative ``ttl`` or a ``max_entries`` below 1.
    """

    def __init__(
        self,
        ttl: float,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        refresh_in_background: bool = False,
    ) -> None:
        if ttl < 0:
            raise ValueError(f"ttl must be >= 0 seconds, got {ttl}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl = ttl
        self.max_entries = max_entries
        self.refresh_in_background = refresh_in_background
        self._clock = clock
        self._values: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._flights: dict[K, asyncio.Future[V]] = {}
        self.fetches = 0
        """Fetches started (each one request to whatever ``fetch`` asks)."""

    def __len__(self) -> int:
        return len(self._values)

    def cached(self, key: K) -> V | None:
        """The value of ``key`` if it is still within its ``ttl``, else None (no fetch)."""
        entry = self._values.get(key)
        if entry is None:
            return None
        expires, value = entry
        if self._clock() >= expires:
            del self._values[key]
            return None
        self._values.move_to_end(key)
        return value

    async def get(
        self,
        key: K,
        fetch: Callable[[], Awaitable[V]],
        fresh: Callable[[V], bool] | None = None,
    ) -> V:
        """The value of ``key``: the cached one if within its ``ttl`` and ``fresh(value)`` (when
        given) is True; else the answer of the request in flight for ``key``, or of a new
        ``fetch()``. Raises what that fetch raised (nothing cached then)."""
        value, _ = await self.get_fetched(key, fetch, fresh)
        return value

    async def get_fetched(
        self,
        key: K,
        fetch: Callable[[], Awaitable[V]],
        fresh: Callable[[V], bool] | None = None,
    ) -> tuple[V, bool]:
        """Like :meth:`get`, and whether this call started the fetch that answered it (or, for
        a value served while it is renewed in the background, started that renewal)."""
        entry = self._values.get(key)
        if entry is not None and (fresh is None or fresh(entry[1])):
            expires, value = entry
            if self._clock() < expires:
                self._values.move_to_end(key)
                return value, False
            if self.refresh_in_background:
                self._values.move_to_end(key)
                started = key not in self._flights
                if started:
                    self._start(key, fetch)
                return value, started
        flight = self._flights.get(key)
        started = flight is None
        if flight is None:
            flight = self._start(key, fetch)
        return await asyncio.shield(flight), started

    def _start(self, key: K, fetch: Callable[[], Awaitable[V]]) -> asyncio.Future[V]:
        flight = asyncio.ensure_future(fetch())
        self.fetches += 1
        self._flights[key] = flight
        flight.add_done_callback(lambda done: self._landed(key, done))
        return flight

    def invalidate(self, key: K) -> None:
        """Forget ``key``'s value (a request in flight still answers its waiters)."""
        self._values.pop(key, None)

    def _landed(self, key: K, flight: asyncio.Future[V]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if flight.cancelled() or flight.exception() is not None:
            # Never keep what a failed request left: a stale value must not outlive its renewal.
            self._values.pop(key, None)
            if not flight.cancelled():
                log.debug("request for %r failed: %s", key, flight.exception())
            return
        self._values[key] = (self._clock() + self.ttl, flight.result())
        self._values.move_to_end(key)
        while len(self._values) > self.max_entries:
            self._values.popitem(last=False)
