"""strata_operator.memory: the TLS read buffer setting and the heap trimmer (real glibc)."""

from __future__ import annotations

import threading
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
    trimmer = memory.HeapTrimmer()
    assert not trimmer.trim_if_used()  # nothing finished yet
    trimmer.closed()
    trimmer.closed()
    assert trimmer.trim_if_used() and trimmer.trims == 1  # real glibc malloc_trim
    assert not trimmer.trim_if_used()  # no request since


def test_the_trimming_thread_starts_once_and_stops() -> None:
    trimmer = memory.HeapTrimmer(period=0.01)
    trimmer.start()
    trimmer.start()
    trimmer.closed()
    while trimmer.trims == 0:
        threading.Event().wait(0.01)
    trimmer.stop()
    assert trimmer.trims == 1


def test_rss_is_read_from_proc() -> None:
    assert 1 < memory.rss_mib() < 100_000
