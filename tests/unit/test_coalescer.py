"""Group commit of sidecar reports: one flush per key per interval (issue 15, item 3)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from strata_operator.reports.coalescer import Coalescer, QueueFull

pytestmark = pytest.mark.unit


def test_concurrent_submits_share_one_flush_and_each_gets_its_result() -> None:
    flushes: list[tuple[str, list[int]]] = []

    async def flush(key: str, items: Sequence[int]) -> list[int]:
        flushes.append((key, list(items)))
        await asyncio.sleep(0)
        return [i * 10 for i in items]

    async def main() -> list[int]:
        batches: Coalescer[str, int, int] = Coalescer(flush, interval=0.0)
        return await asyncio.gather(*(batches.submit("p", i) for i in range(1000)))

    results = asyncio.run(main())
    assert results == [i * 10 for i in range(1000)]
    assert flushes == [("p", list(range(1000)))]


def test_items_arriving_during_a_flush_go_into_the_next_one_and_keys_are_independent() -> None:
    flushes: list[tuple[str, int]] = []
    release = asyncio.Event

    async def main() -> None:
        gate = release()

        async def flush(key: str, items: Sequence[int]) -> list[int]:
            flushes.append((key, len(items)))
            if key == "a" and len(flushes) == 1:
                await gate.wait()
            return list(items)

        batches: Coalescer[str, int, int] = Coalescer(flush, interval=0.0)
        first = asyncio.create_task(batches.submit("a", 0))
        await asyncio.sleep(0.01)  # the first flush of "a" is running and blocked
        later = [asyncio.create_task(batches.submit("a", i)) for i in range(1, 51)]
        other = asyncio.create_task(batches.submit("b", 99))
        assert await other == 99  # "b" is not held up by "a"
        gate.set()
        assert await first == 0
        assert await asyncio.gather(*later) == list(range(1, 51))

    asyncio.run(main())
    assert flushes == [("a", 1), ("b", 1), ("a", 50)]


def test_a_failing_flush_fails_its_batch_only_and_a_full_queue_is_refused() -> None:
    async def main() -> None:
        calls = 0

        async def flush(key: str, items: Sequence[int]) -> list[int]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("apiserver down")
            return list(items)

        batches: Coalescer[str, int, int] = Coalescer(flush, interval=0.0, max_pending=2)
        with pytest.raises(RuntimeError, match="apiserver down"):
            await batches.submit("a", 1)
        assert await batches.submit("a", 2) == 2
        held = [asyncio.create_task(batches.submit("x", i)) for i in range(2)]
        await asyncio.sleep(0)  # both queued; the flush task has not run yet
        with pytest.raises(QueueFull):
            await batches.submit("x", 3)
        assert await asyncio.gather(*held) == [0, 1]

    asyncio.run(main())
