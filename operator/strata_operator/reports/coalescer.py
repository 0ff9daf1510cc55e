"""Group commit: items submitted for one key are handled together, at most once per interval.

Rule of this module: asyncio only (no Kubernetes, no kopf); the flush function is the caller's.
The report receiver uses it to fold every report that arrived for a policy into ONE status patch:
the first report after a quiet period is flushed at once; reports arriving while a flush runs, or
within ``interval`` seconds after it, wait for the next flush. A submitter waits for the flush
that contains its item, so its latency is about one flush (plus at most ``interval``) however many
items are queued, and the apiserver sees at most one write per key per interval.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from strata.errors import StrataError

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")

Flush = Callable[[K, Sequence[T]], Awaitable[Sequence[R]]]


class QueueFull(StrataError):
    """Too many items are waiting for one key; the caller should retry later."""


class Coalescer(Generic[K, T, R]):
    """Per-key batching of ``submit(key, item)`` calls into ``flush(key, items) -> results``.

    ``flush`` returns one result per item, in order; an exception it raises is raised by every
    ``submit`` of that batch. ``interval``: seconds between the starts of two flushes of one key
    (0: back to back). ``max_pending``: items one key may queue before ``submit`` raises
    :class:`QueueFull`.
    """

    def __init__(
        self, flush: Flush[K, T, R], *, interval: float = 1.0, max_pending: int = 20_000
    ) -> None:
        self._flush = flush
        self.interval = interval
        self.max_pending = max_pending
        self._pending: dict[K, list[tuple[T, asyncio.Future[R]]]] = {}
        self._tasks: dict[K, asyncio.Task[None]] = {}

    def pending(self, key: K) -> int:
        return len(self._pending.get(key) or ())

    async def submit(self, key: K, item: T) -> R:
        """Queue ``item`` and wait for the result of the flush that handles it."""
        queue = self._pending.setdefault(key, [])
        if len(queue) >= self.max_pending:
            raise QueueFull(f"{len(queue)} items already wait for {key!r}")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        # Mark the outcome as retrieved even when the submitter was cancelled meanwhile.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        queue.append((item, future))
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(self._run(key))
        return await asyncio.shield(future)

    async def _run(self, key: K) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = self._pending.pop(key, None)
                if not batch:
                    return  # no await since the pop: a submit now starts a new task
                started = loop.time()
                try:
                    results = await self._flush(key, [item for item, _ in batch])
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        if not future.done():
                            future.set_result(result)
                await asyncio.sleep(max(0.0, started + self.interval - loop.time()))
        finally:
            self._tasks.pop(key, None)

    async def close(self) -> None:
        """Cancel running flush loops (at shutdown)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
