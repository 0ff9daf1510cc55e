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


# -- the layout (issue 14 item 6): the whole tensor part of the previous encode, reused -----------


def _hit(state: Any, cache: EncodeCache) -> bool:
    before = cache.layout_hits
    assert _fingerprint(state, cache) == _fingerprint(state, None)
    return cache.layout_hits == before + 1


def test_an_unchanged_layout_is_replayed_and_any_layout_change_is_not() -> None:
    state = _state()
    state["sub"] = {"a": torch.ones(3), "n": 1, "l": [torch.zeros(2, dtype=torch.int32), "x"]}
    cache = EncodeCache()
    assert not _hit(state, cache)  # the first encode builds the layout
    assert _hit(state, cache)  # unchanged
    state["step"] = 2  # non-tensor values are re-encoded every time
    state["sub"]["n"] = {"nested": (1, 2.5)}
    state["sub"]["l"].reverse()  # the tree changes, the order of the tensors does not
    state["base"].add_(1)  # the bytes change, the layout does not
    assert _hit(state, cache)

    changes = [
        lambda s: s["many"].append(torch.randn(4)),  # a new tensor
        lambda s: s["many"].pop(),  # a tensor less
        lambda s: s["ints"].resize_(70),  # a new, larger storage under the same object
        lambda s: s["ints"].resize_(7, 1),  # another shape over the same storage
        lambda s: s["t"].t_(),  # the same object re-strided in place
        lambda s: setattr(s["sub"]["a"], "data", torch.ones(3, dtype=torch.float64)),  # dtype
        lambda s: s["sub"]["a"].requires_grad_(True),
        lambda s: s.update(view=s["base"][3:]),  # another view of a shared storage
        lambda s: s["many"].reverse(),  # the same tensors in another order
        lambda s: s.update(sub=dict(reversed(s["sub"].items()))),  # order of a dict
        lambda s: s.update(alias=s["many"][0]),  # a tensor met twice
    ]
    for i, change in enumerate(changes):
        change(state)
        assert not _hit(state, cache), i  # a full encode, equal to the uncached one
        assert _hit(state, cache), i  # and the new layout is replayed from then on


def test_a_new_tensor_object_with_the_same_layout_is_replayed_if_its_storage_is_its_own() -> None:
    """``torch.get_rng_state()`` per save: a new tensor each time, same dtype/shape/size."""
    state: dict[str, Any] = {"w": torch.randn(8), "rng": torch.get_rng_state(), "n": 1}
    cache = EncodeCache()
    _hit(state, cache)
    old = state["rng"]
    state["rng"] = torch.get_rng_state()
    assert _hit(state, cache)
    lay = cache.layout
    assert lay is not None and lay.live[1] is state["rng"]
    assert not any(t is old for t in lay.occ_tensors + lay.live)  # the old one is let go
    state["rng"] = state["rng"].view(-1)  # a new view of the same storage: the same layout
    assert _hit(state, cache)

    state["rng"] = state["w"].view(torch.uint8)  # same dtype and size, but another's storage
    assert not _hit(state, cache)
    state["rng"] = torch.get_rng_state()
    assert not _hit(state, cache)  # the previous layout had a shared storage there
    state["rng"] = torch.get_rng_state().to(torch.int8)  # another dtype
    assert not _hit(state, cache)
    state["rng"] = torch.nn.Parameter(torch.zeros(state["rng"].shape, dtype=torch.int8), False)
    assert not _hit(state, cache)  # a Parameter where a tensor was (the tree node differs)
    state["rng"] = torch.empty(state["rng"].shape, dtype=torch.int8)[:-1]  # a smaller one
    assert not _hit(state, cache)


def test_a_replayed_encode_refuses_what_the_full_one_refuses_with_its_path() -> None:
    state = {"w": torch.ones(2), "x": 1}
    cache = EncodeCache()
    codec.encode(state, cache=cache)
    state["x"] = object()
    try:
        codec.encode(state, cache=cache)
    except TypeError as exc:
        assert "state['x']" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("an unsupported value was encoded")
    state["x"] = [state]  # a cycle
    try:
        codec.encode(state, cache=cache)
    except TypeError as exc:
        assert "cycle" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("a cycle was encoded")


def test_layout_json_is_serialised_once_and_spliced_byte_identically() -> None:
    from strata.format.sealed import seal

    state: dict[str, Any] = {
        "tensors": [],
        "storages": [],  # keys that look like the manifest's own fields
        "w": torch.ones(3, 2).t(),
        "p": torch.nn.Parameter(torch.randn(2)),
        "text": 'quote " and ,"tree":null,"tensors":[],"storages":[], and ünïcödé \x00\n',
        "f": 1.5e300,
        "big": {f"k{i}\u00e9\t": [i, i * 0.5, None, True, -(2**62)] for i in range(100)},
        "small": {"x": [torch.zeros(1), {"y": "z"}], "q": (1, "2"), 3: 4},
        "tensor_dict": {f"t{i}": torch.full((2,), float(i)) for i in range(80)},
    }
    cache = EncodeCache()
    for step in range(3):
        enc = codec.encode(state, cache=cache)
        assert enc.layout is not None
        m = enc.manifest(job_id="j", step=step, rank=0, world_size=1, writer_id="w")
        m = m.model_copy(update={"incarnation": "i-1"})
        assert m.to_json() == seal(m.model_dump_json().encode())
        assert m.model_copy(update={"tensors": m.tensors[:1]}).to_json() == seal(
            m.model_copy(update={"tensors": m.tensors[:1]}).model_dump_json().encode()
        )
        state["text"] += "!"
        state["big"][f"k{step}\u00e9\t"][0] = -step  # a scalar deep in a big dict changes
    assert enc.layout is not None and enc.layout.json.serialised == 1
    # Unchanged containers are the previous save's node objects (their JSON is kept)
    again = codec.encode(state, cache=cache)
    assert again.tree["tensor_dict"] is enc.tree["tensor_dict"]
    # ... also after the same manifest was serialised twice (the save, then its checksum pass)
    m.model_copy(update={"crc32c": 1, "chunk_crc32c": [1]}).to_json()
    kept = enc.layout.json._tree.values()
    assert any(node is again.tree["tensor_dict"] for node, _ in kept)
    assert again.tree["small"]["__dict__"] is not None and again.tree is not enc.tree


def test_the_cached_copy_plan_writes_the_uncached_bytes_and_zeroes_the_padding() -> None:
    from concurrent.futures import ThreadPoolExecutor

    state = {
        "a": torch.randn(3),
        "b": [torch.arange(5, dtype=torch.int8) + i for i in range(50)],  # 59 padding bytes each
        "big": torch.randn(300_000),  # 1.2 MB: split between the copy threads
    }
    ref_enc = codec.encode(state)
    ref = bytearray(ref_enc.data_nbytes)
    codec.write_data(ref_enc, ref)
    cache = EncodeCache()
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):  # the first builds the plan, the others reuse it
            enc = codec.encode(state, cache=cache)
            got = bytearray(b"\xff" * enc.data_nbytes)  # a reused slot holds old bytes
            codec.write_data(enc, got, pool=pool)
            assert got == ref
            # skip= (strata.client.reuse): those storages' bytes are left as they are
            got = bytearray(b"\xff" * enc.data_nbytes)
            codec.write_data(enc, got, pool=pool, skip=frozenset({1, 51}))
            kept = [enc.storages[i] for i in (1, 51)]
            for se in kept:
                assert got[se.offset : se.offset + se.nbytes] == b"\xff" * se.nbytes
                got[se.offset : se.offset + se.nbytes] = ref[se.offset : se.offset + se.nbytes]
            assert got == ref
    assert enc.layout is not None and len(enc.layout.plans[3]) > 1


def test_a_manifest_read_back_as_written_is_not_parsed_again_and_any_other_bytes_are() -> None:
    """The checksum pass reads back the manifest the save just wrote (bench W3: 0.2 s of
    validation per read of a 10,000-tensor manifest): the same bytes give the same manifest."""
    from strata.errors import ManifestError
    from strata.format.manifest import Manifest

    state = {"w": [torch.randn(3) for _ in range(5)], "step": 1}
    enc = codec.encode(state, cache=EncodeCache())
    m = enc.manifest(job_id="j", step=1, rank=0, world_size=1, writer_id="w")
    raw = m.to_json()
    assert Manifest.from_json(raw, "m") is m
    again = Manifest.from_json(bytes(bytearray(raw)), "m")  # equal bytes, another object
    assert again is m
    checked = m.model_copy(update={"crc32c": 7, "chunk_crc32c": [7]})
    assert Manifest.from_json(checked.to_json(), "m") is checked
    # Bytes that differ parse (and fail) as always; a manifest without a layout is not kept.
    flipped = bytearray(raw)
    flipped[-10] ^= 1
    try:
        Manifest.from_json(bytes(flipped), "m")
    except ManifestError:
        pass
    else:  # pragma: no cover
        raise AssertionError("a corrupt manifest parsed")
    other = m.model_copy(update={"step": 2}).model_dump_json()
    plain = Manifest.model_validate_json(other)  # no layout: not remembered
    parsed = Manifest.from_json(plain.to_json(), "m")
    assert parsed == plain and parsed is not plain
    assert parsed != m and Manifest.model_validate_json(m.model_dump_json()) == m
