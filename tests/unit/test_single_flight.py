"""The admission webhook's single-flight cache (strata_operator.admission.single_flight): one
request per key at a time, answers kept for the TTL, failures never kept."""

from __future__ import annotations

import asyncio

import pytest

from strata_operator.admission.single_flight import SingleFlightCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Fetcher:
    """Counts calls; each call waits for ``release`` then answers ``value`` or raises ``error``."""

    def __init__(self, value: str = "v") -> None:
        self.calls = 0
        self.value = value
        self.error: Exception | None = None
        self.release = asyncio.Event()

    async def __call__(self) -> str:
        self.calls += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return f"{self.value}{self.calls}"


def test_concurrent_callers_share_one_request_and_later_ones_the_cached_answer() -> None:
    async def main() -> None:
        cache: SingleFlightCache[str, str] = SingleFlightCache(ttl=5, clock=Clock())
        fetch = Fetcher()
        waiters = [asyncio.create_task(cache.get_fetched("k", fetch)) for _ in range(50)]
        await asyncio.sleep(0)
        fetch.release.set()
        answers = await asyncio.gather(*waiters)
        assert fetch.calls == 1
        assert [v for v, _ in answers] == ["v1"] * 50
        assert [started for _, started in answers].count(True) == 1
        assert await cache.get("k", fetch) == "v1"
        assert fetch.calls == 1

    asyncio.run(main())


def test_an_answer_expires_after_its_ttl() -> None:
    async def main() -> None:
        clock = Clock()
        cache: SingleFlightCache[str, str] = SingleFlightCache(ttl=5, clock=clock)
        fetch = Fetcher()
        fetch.release.set()
        assert await cache.get("k", fetch) == "v1"
        clock.now += 4.9
        assert await cache.get("k", fetch) == "v1"
        clock.now += 0.1
        assert await cache.get("k", fetch) == "v2"
        assert fetch.calls == 2

    asyncio.run(main())


def test_a_failure_reaches_every_waiter_and_is_not_kept() -> None:
    async def main() -> None:
        cache: SingleFlightCache[str, str] = SingleFlightCache(ttl=5, clock=Clock())
        fetch = Fetcher()
        fetch.error = RuntimeError("apiserver said 500")
        waiters = [asyncio.create_task(cache.get("k", fetch)) for _ in range(5)]
        await asyncio.sleep(0)
        fetch.release.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        assert fetch.calls == 1
        assert len(cache) == 0
        fetch.error = None
        assert await cache.get("k", fetch) == "v2"

    asyncio.run(main())


def test_a_stale_value_is_fetched_again_and_invalidate_forgets_a_key() -> None:
    async def main() -> None:
        cache: SingleFlightCache[str, str] = SingleFlightCache(ttl=5, clock=Clock())
        fetch = Fetcher()
        fetch.release.set()
        assert await cache.get("k", fetch) == "v1"
        assert await cache.get("k", fetch, fresh=lambda v: v != "v1") == "v2"
        assert await cache.get("k", fetch) == "v2"
        cache.invalidate("k")
        assert await cache.get("k", fetch) == "v3"

    asyncio.run(main())


def test_a_cancelled_waiter_does_not_cancel_the_shared_request() -> None:
    async def main() -> None:
        cache: SingleFlightCache[str, str] = SingleFlightCache(ttl=5, clock=Clock())
        fetch = Fetcher()
        first = asyncio.create_task(cache.get("k", fetch))
        second = asyncio.create_task(cache.get("k", fetch))
        await asyncio.sleep(0)
        first.cancel()
        fetch.release.set()
        assert await second == "v1"
        assert first.cancelled()
        assert cache.cached("k") == "v1"

    asyncio.run(main())


def test_the_least_recently_used_key_goes_beyond_max_entries() -> None:
    async def main() -> None:
        cache: SingleFlightCache[str, str] = SingleFlightCache(ttl=5, max_entries=2, clock=Clock())
        fetch = Fetcher()
        fetch.release.set()
        await cache.get("a", fetch)
        await cache.get("b", fetch)
        await cache.get("a", fetch)  # a is now the most recently used
        await cache.get("c", fetch)
        assert len(cache) == 2
        assert cache.cached("b") is None
        assert cache.cached("a") == "v1"

    asyncio.run(main())


@pytest.mark.parametrize(("ttl", "entries"), [(-1.0, 10), (1.0, 0)])
def test_bad_settings_are_refused(ttl: float, entries: int) -> None:
    with pytest.raises(ValueError, match="must be >="):
        SingleFlightCache(ttl=ttl, max_entries=entries)


def test_past_its_ttl_a_value_is_served_while_one_request_renews_it() -> None:
    async def main() -> None:
        clock = Clock()
        cache: SingleFlightCache[str, str] = SingleFlightCache(
            ttl=5, clock=clock, refresh_in_background=True
        )
        fetch = Fetcher()
        fetch.release.set()
        assert await cache.get("k", fetch) == "v1"
        clock.now += 5
        fetch.release.clear()
        # Old answers at once, one renewal in flight for all of them.
        assert [await cache.get_fetched("k", fetch) for _ in range(3)] == [
            ("v1", True),
            ("v1", False),
            ("v1", False),
        ]
        await asyncio.sleep(0)
        assert fetch.calls == 2
        fetch.release.set()
        await asyncio.sleep(0.01)
        assert await cache.get("k", fetch) == "v2"
        # A stale value the caller cannot use is never served: it waits for the answer.
        clock.now += 5
        assert await cache.get("k", fetch, fresh=lambda v: v != "v2") == "v3"

    asyncio.run(main())


def test_a_failed_renewal_drops_the_value_and_the_next_caller_sees_the_failure() -> None:
    async def main() -> None:
        clock = Clock()
        cache: SingleFlightCache[str, str] = SingleFlightCache(
            ttl=5, clock=clock, refresh_in_background=True
        )
        fetch = Fetcher()
        fetch.release.set()
        await cache.get("k", fetch)
        clock.now += 5
        fetch.error = RuntimeError("403: may not create secrets")
        assert await cache.get("k", fetch) == "v1"
        await asyncio.sleep(0.01)
        assert cache.cached("k") is None
        with pytest.raises(RuntimeError, match="403"):
            await cache.get("k", fetch)

    asyncio.run(main())
