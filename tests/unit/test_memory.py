"""strata_operator.memory: the TLS read buffer setting and the heap trimmer (real glibc)."""

from __future__ import annotations

import asyncio
from asyncio import sslproto

import pytest

from strata_operator import memory

pytestmark = pytest.mark.unit


def test_tls_buffers_are_limited_and_a_buffer_below_one_record_is_refused() -> None:
    default = sslproto.SSLProtocol.max_size
    try:
        memory.limit_tls_buffers()
        assert sslproto.SSLProtocol.max_size == memory.TLS_READ_BUFFER_BYTES < default
        with pytest.raises(ValueError, match="below one TLS record"):
            memory.limit_tls_buffers(4096)
    finally:
        sslproto.SSLProtocol.max_size = default


def test_the_trimmer_trims_only_after_requests_finished() -> None:
    async def scenario() -> tuple[int, int]:
        trimmer = memory.HeapTrimmer(period=0.01)
        task = asyncio.create_task(trimmer.run())
        await asyncio.sleep(0.1)
        idle = trimmer.trims
        trimmer.closed()
        while trimmer.trims == idle:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # no new request: no further trim
        after = trimmer.trims
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return idle, after

    idle, after = asyncio.run(scenario())
    assert (idle, after) == (0, 1)


def test_rss_is_read_from_proc() -> None:
    assert 1 < memory.rss_mib() < 100_000
