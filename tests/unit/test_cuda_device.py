"""The CUDA implementation of the device seam, against a recording stand-in of the runtime
binding (no GPU here): the flags and the error handling of registration."""

from __future__ import annotations

import pytest

from strata.client.cuda_host import HostRegistry
from strata.client.device import HOST_REGISTER_PORTABLE, CudaDevice, HostRegisterError


class _Runtime:
    """Records ``cudaHostRegister`` calls; answers ``code``."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, addr: int, nbytes: int, flags: int) -> int:
        self.calls.append((addr, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


def test_registration_is_portable() -> None:
    rt = _Runtime()
    CudaDevice(cudart=rt, last_error=lambda: 0).register_host(4096, 8192, 0)
    assert rt.calls == [(4096, 8192, HOST_REGISTER_PORTABLE)]


def test_a_refused_registration_clears_the_threads_cuda_error() -> None:
    """The failed call's error stays the thread's "last error" otherwise: torch's next kernel
    launch check on that thread raises it as its own."""
    cleared: list[int] = []

    def last_error() -> int:
        cleared.append(2)
        return 2

    dev = CudaDevice(cudart=_Runtime(code=2), last_error=last_error)
    with pytest.raises(HostRegisterError) as exc:
        dev.register_host(4096, 8192, 0)
    assert exc.value.code == 2 and cleared == [2]


def test_one_refusal_leaves_registration_on_for_other_slots() -> None:
    rt = _Runtime(code=2)
    reg = HostRegistry(device=CudaDevice(cudart=rt, last_error=lambda: 0))
    assert reg.register(4096, 100) is False
    rt.code = 0
    assert reg.register(8192, 100) is True
    assert reg.registered_bytes == 100 and reg.failures == 1 and reg.fallback_reason is None
    reg.close()
    assert rt.unregistered == [8192]
