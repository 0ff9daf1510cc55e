"""The loader's host view for CUDA tensors: taken as a tensor, never tested for truth."""

from __future__ import annotations

from typing import Any

import torch

from strata.client.loader import _OnePass
from strata.format import codec


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` (what the loader looks at to pick its path)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def _manifest(state: Any) -> Any:
    enc = codec.encode(state, rank=0, world_size=1)
    return enc.manifest(
        job_id="ns.j", step=1, rank=0, world_size=1, writer_id="w", chunk_size=1 << 20
    )


def test_a_registered_host_view_of_many_bytes_is_taken_not_tested_for_truth() -> None:
    """``device_source() or False`` called bool() on the registered slot view: RuntimeError
    (ambiguous truth value) on every RAM restore of a CUDA state whose slot was registered."""
    m = _manifest({"w": torch.zeros(1024)})
    host = torch.zeros(m.data_nbytes, dtype=torch.uint8)
    one = _OnePass(m, host.data_ptr(), None, 1, device_source=lambda: host)
    live = torch.Tensor._make_subclass(_ReportsCuda, torch.zeros(1024))
    te, se = m.tensors[0], m.storages[0]
    assert one.sink(te, se, live) is True
    assert one.fast_bytes == 4096 and one.cuda


def test_without_a_host_view_the_codec_copies_cuda_tensors() -> None:
    m = _manifest({"w": torch.zeros(8)})
    one = _OnePass(m, 0, None, 1, device_source=lambda: None)
    live = torch.Tensor._make_subclass(_ReportsCuda, torch.zeros(8))
    assert one.sink(m.tensors[0], m.storages[0], live) is False
    assert one.fast_bytes == 0
