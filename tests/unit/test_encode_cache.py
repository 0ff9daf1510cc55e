"""EncodeCache (issue 14, W3): a cached encode is exactly the uncached one, whatever changed."""

from __future__ import annotations

from typing import Any

import torch

from strata.format import codec
from strata.format.encode_cache import EncodeCache


def _fingerprint(state: Any, cache: EncodeCache | None) -> tuple[Any, ...]:
    enc = codec.encode(state, cache=cache)
    data = bytearray(enc.data_nbytes)
    codec.write_data(enc, data)
    return (
        enc.tree,
        [t.model_dump() for t in enc.tensors],
        [s.model_dump() for s in enc.storages],
        enc.data_nbytes,
        bytes(data),
    )


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return {
        "w": torch.nn.Parameter(torch.randn(3, 5, generator=g)),
        "base": base,
        "view": base[2:],
        "t": base.t(),
        "ints": torch.arange(7),
        "many": [torch.randn(4, generator=g) for _ in range(20)],
        "step": 1,
    }


def test_cached_encodes_equal_uncached_ones_as_the_state_changes() -> None:
    state = _state()
    cache = EncodeCache()
    assert _fingerprint(state, cache) == _fingerprint(state, None)
    assert len(cache.old) == 5 + 20
    assert _fingerprint(state, cache) == _fingerprint(state, None)  # all hits

    state["base"].add_(1)  # values change, layout does not
    state["step"] = 2
    assert _fingerprint(state, cache) == _fingerprint(state, None)

    state["ints"].resize_(70)  # a new, larger storage under the same tensor object
    assert _fingerprint(state, cache) == _fingerprint(state, None)

    state["many"][3] = torch.zeros(9)  # a new tensor in the same place
    state["many"].pop(0)  # every later storage moves
    assert _fingerprint(state, cache) == _fingerprint(state, None)

    with torch.no_grad():
        state["w"].requires_grad_(False)
    state["view"] = state["base"][1:]  # another view of the same storage
    state["t"].set_(torch.randn(2, 2))  # the same object over another storage
    assert _fingerprint(state, cache) == _fingerprint(state, None)


def test_the_cache_forgets_tensors_the_state_no_longer_holds() -> None:
    state = _state()
    cache = EncodeCache()
    codec.encode(state, cache=cache)
    dropped = state.pop("many")
    codec.encode(state, cache=cache)
    assert not any(c.tensor is t for c in cache.old.values() for t in dropped)
