"""Where the replica exchange puts a tensor on the wire: device memory for a group that
carries only that (NCCL), host memory otherwise (stand-in devices of the device seam)."""

from __future__ import annotations

import torch

from strata.client.device import StandInDevice
from strata.client.sharded import _on_wire, _wire_index


def test_an_nccl_group_gets_device_tensors_and_a_gloo_group_host_tensors() -> None:
    dev = StandInDevice(devices=2)
    on1 = dev.tensor(torch.arange(6.0), 1)
    host = torch.arange(6.0)
    with dev.using(1):
        assert _wire_index(dev, on1, on_device=True) == 1
        assert _wire_index(dev, host, on_device=True) == 1  # a host tensor: the current device
    assert _wire_index(dev, on1, on_device=False) is None
    assert _on_wire(dev, on1, on_device=True) is on1  # no staging copy for NCCL
    staged = _on_wire(dev, host, on_device=True)
    assert dev.index_of(staged) == 0 and torch.equal(staged, host)
    out = _on_wire(dev, on1, on_device=False)
    assert dev.index_of(out) is None and torch.equal(out, on1)
    assert dev.wire_on_device("nccl") and dev.wire_on_device("cpu:gloo,cuda:nccl")
    assert not dev.wire_on_device("gloo")
    dev.close()


def test_a_non_contiguous_device_tensor_is_made_contiguous_for_the_wire() -> None:
    dev = StandInDevice()
    t = dev.tensor(torch.arange(12.0).reshape(3, 4)).t()
    out = _on_wire(dev, t, on_device=True)
    assert out.is_contiguous() and dev.index_of(out) == 0 and torch.equal(out, t)
    dev.close()
