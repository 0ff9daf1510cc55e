"""State tree codec: exact round trips, every dtype, tied weights, views, errors naming paths."""

from __future__ import annotations

import collections
import json
import math
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.errors import CodecError
from strata.format import codec
from strata.format.manifest import ALIGN, Manifest

pytestmark = pytest.mark.unit


def roundtrip(state: Any) -> tuple[Any, Manifest]:
    """Encode, write, serialise the manifest to JSON and back, load new tensors."""
    enc, data = codec.dumps(state)
    m = enc.manifest(job_id="j", step=1, rank=0, world_size=1, writer_id="w")
    m2 = Manifest.from_json(m.to_json(), "test")
    return codec.load(m2, data), m2


def same(a: Any, b: Any) -> bool:
    """Exact equality: types, float bits (nan == nan), tensor bytes, dtypes, shapes, strides."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.requires_grad == b.requires_grad
            and _bytes(a) == _bytes(b)
        )
    if isinstance(a, np.ndarray):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, np.generic):
        return bool(a.dtype == b.dtype and a.tobytes() == b.tobytes())
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _bytes(t: torch.Tensor) -> bytes:
    """The bytes of the elements the view covers (through its strides)."""
    c = t.detach().contiguous()
    if c.numel() == 0:
        return b""
    return bytes(
        torch.empty(0, dtype=torch.uint8)
        .set_(
            c.untyped_storage(),
            c.storage_offset() * c.element_size(),
            (c.numel() * c.element_size(),),
            (1,),
        )
        .numpy()
    )


# --------------------------------------------------------------------------- hypothesis round trip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # includes ints far outside int64
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=False),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda:1")]),
    st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
)

small_tensors = st.builds(
    lambda shape, dtype, seed: torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(
        dtype
    ),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.bool]),
    st.integers(0, 1000),
)

numpy_values = st.one_of(
    st.builds(
        lambda n, dt, seed: np.random.default_rng(seed).integers(0, 100, n).astype(dt),
        st.integers(0, 6),
        st.sampled_from(["<i8", "<u4", "<f4", "<f8", "?", "<c16"]),
        st.integers(0, 99),
    ),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.floats(allow_nan=False, width=32).map(np.float32),
    st.frozensets(st.integers(-5, 5), max_size=3),
    st.sets(st.text(max_size=3), max_size=3),
)

keys = st.one_of(st.text(max_size=6), st.integers(-3, 10), st.sampled_from(["__tensor__", "__x"]))

trees = st.recursive(
    st.one_of(scalars, small_tensors, numpy_values),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=20,
)


@given(trees)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_state_tree_roundtrips_exactly(state: Any) -> None:
    loaded, _ = roundtrip({"s": state})
    assert same(loaded, {"s": state})


@given(st.lists(st.floats(allow_nan=True), min_size=1, max_size=5))
@settings(max_examples=50, deadline=None)
def test_float_bits_survive_json(xs: list[float]) -> None:
    loaded, _ = roundtrip(xs)
    assert [x.hex() if not math.isnan(x) else "nan" for x in loaded] == [
        x.hex() if not math.isnan(x) else "nan" for x in xs
    ]


# --------------------------------------------------------------------------- every dtype


def _all_dtypes() -> list[torch.dtype]:
    names = [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", _all_dtypes(), ids=str)
def test_every_cpu_dtype_roundtrips_bitwise(dtype: torch.dtype) -> None:
    raw = torch.randint(
        0,
        256,
        (5 * 3 * dtype.itemsize,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(7),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*experimental.*", category=UserWarning)
        t = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, (5, 3), (3, 1))
        zero_d = torch.empty(0, dtype=dtype).set_(raw.clone().untyped_storage(), 2, (), ())
        empty = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage(0), 0, (0, 4), (4, 1))
        state = {"t": t, "zero_d": zero_d, "empty": empty}
        loaded, m = roundtrip(state)
    for k in state:
        assert loaded[k].dtype == dtype
        assert loaded[k].shape == state[k].shape
        assert _bytes(loaded[k]) == _bytes(state[k]), k
    assert {e.dtype for e in m.tensors} == {str(dtype).removeprefix("torch.")}


def test_storages_are_aligned() -> None:
    _, m = roundtrip(
        {
            "a": torch.ones(3, dtype=torch.int8),
            "b": torch.ones(5),
            "c": torch.ones(1, dtype=torch.float64),
        }
    )
    assert all(s.offset % ALIGN == 0 for s in m.storages)


# --------------------------------------------------------------------------- sharing and views


def test_tied_weights_restore_as_tied_and_views_keep_strides() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "emb": base,
        "head": base,  # the same tensor object twice (tied weights)
        "t": base.t(),  # non-contiguous view
        "col": base[:, 2],  # strided view with a storage offset
        "other": torch.zeros(2),
    }
    loaded, m = roundtrip(state)
    assert len(m.storages) == 2
    assert loaded["emb"] is loaded["head"]
    for k in ("t", "col"):
        assert loaded[k].untyped_storage().data_ptr() == loaded["emb"].untyped_storage().data_ptr()
        assert loaded[k].stride() == state[k].stride()
        assert loaded[k].storage_offset() == state[k].storage_offset()
        assert torch.equal(loaded[k], state[k])
    loaded["emb"][0, 2] = -1.0
    assert loaded["col"][0] == -1.0 and loaded["t"][2, 0] == -1.0


def test_tied_module_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    loaded, m = roundtrip({"params": list(model.parameters()), "sd": model.state_dict()})
    assert len(m.storages) == 1
    assert isinstance(loaded["params"][0], torch.nn.Parameter)
    assert loaded["sd"]["0.weight"].data_ptr() == loaded["sd"]["1.weight"].data_ptr()
    assert isinstance(loaded["sd"], collections.OrderedDict)
    # torch sets _metadata on state dicts; its stubs do not declare it.
    assert loaded["sd"]._metadata == model.state_dict()._metadata  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- non-tensor state


def test_rng_states_and_optimizer_roundtrip() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    gen = np.random.default_rng(5)
    gen.random(3)
    random.seed(3)
    state: dict[str, Any] = {
        "optim": opt.state_dict(),
        "py_rng": random.getstate(),
        "np_legacy": np.random.get_state(),
        "np_gen": gen.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "loader": {
            "epoch": 3,
            "offset": 1234,
            "order": np.arange(7, dtype=np.int64),
            "seed": np.uint64(2**63 + 5),
        },
        "meta": {
            "dtype": torch.bfloat16,
            "size": torch.Size([2, 3]),
            "dev": torch.device("cpu"),
            "blob": b"\x00\xff",
            "s": {1, 2},
        },
    }
    loaded, _ = roundtrip(state)
    assert same(loaded["optim"], state["optim"])
    assert isinstance(next(iter(loaded["optim"]["state"])), int)
    random.setstate(loaded["py_rng"])
    a = random.random()
    random.setstate(state["py_rng"])
    assert a == random.random()
    np.random.set_state(loaded["np_legacy"])
    x = np.random.rand()
    np.random.set_state(state["np_legacy"])
    assert x == np.random.rand()
    g2 = np.random.default_rng()
    g2.bit_generator.state = loaded["np_gen"]
    assert g2.random() == gen.random()
    assert torch.equal(loaded["torch_rng"], state["torch_rng"])
    assert same(loaded["loader"], state["loader"])
    assert loaded["meta"] == state["meta"]
    # the restored optimizer state loads into a fresh optimizer
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt2.load_state_dict(loaded["optim"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)


def test_manifest_tree_is_plain_json() -> None:
    enc, _ = codec.dumps({"a": (1, 2.5), 3: [None, "x"]})
    json.dumps(enc.tree, allow_nan=False)


# --------------------------------------------------------------------------- errors


class Opaque:
    pass


def test_unknown_type_names_its_path() -> None:
    state = {"optim": {"state": {3: {"fn": Opaque()}}}}
    with pytest.raises(
        TypeError, match=r"state\['optim'\]\['state'\]\[3\]\['fn'\].*Opaque.*nothing is pickled"
    ):
        codec.encode(state)


def test_cycle_is_refused() -> None:
    a: list[Any] = []
    a.append(a)
    with pytest.raises(TypeError, match="cycle"):
        codec.encode({"a": a})


def test_object_arrays_and_subclasses_refused() -> None:
    with pytest.raises(TypeError, match=r"state\['x'\].*object"):
        codec.encode({"x": np.array([object()])})
    with pytest.raises(TypeError, match="sparse"):
        codec.encode({"x": torch.eye(2).to_sparse()})


def test_truncated_data_is_a_clear_error() -> None:
    enc, data = codec.dumps({"w": torch.ones(100)})
    m = enc.manifest(job_id="j", step=1, rank=0, world_size=1, writer_id="w")
    with pytest.raises(CodecError, match="truncated"):
        codec.load(m, data[:10], where="/x/rank-00000.data")


def test_unknown_dtype_and_tag() -> None:
    enc, data = codec.dumps({"w": torch.ones(2)})
    m = enc.manifest(job_id="j", step=1, rank=0, world_size=1, writer_id="w")
    bad = m.model_copy(update={"tensors": [m.tensors[0].model_copy(update={"dtype": "float99"})]})
    with pytest.raises(CodecError, match="float99"):
        codec.load(bad, data)
    bad2 = m.model_copy(update={"tree": {"w": {"__future__": 1}}})
    with pytest.raises(CodecError, match="unknown tag"):
        codec.load(bad2, data)
    bad3 = m.model_copy(update={"tensors": [m.tensors[0].model_copy(update={"shape": [200]})]})
    with pytest.raises(CodecError, match="does not fit"):
        codec.load(bad3, data)


# --------------------------------------------------------------------------- load_into


def test_load_into_copies_in_place_and_keeps_identity() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved_w = model.weight.detach().clone()
    enc, data = codec.dumps({"model": model, "optim": opt, "step": 7, "hist": [1, 2]})
    m = enc.manifest(job_id="j", step=1, rank=0, world_size=1, writer_id="w")

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    w_obj = model2.weight
    hist: list[int] = [9]
    live = {"model": model2, "optim": opt2, "step": 0, "hist": hist}
    out = codec.load_into(live, m, data)
    assert model2.weight is w_obj
    assert torch.equal(model2.weight, saved_w)
    assert opt2.param_groups[0]["lr"] == 0.1
    assert torch.equal(
        opt2.state[model2.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )
    assert out is live and live["step"] == 7 and hist == [1, 2] and live["hist"] is hist


def test_load_into_shape_mismatch_names_path() -> None:
    enc, data = codec.dumps({"model": {"w": torch.ones(3, 4)}})
    m = enc.manifest(job_id="j", step=1, rank=0, world_size=1, writer_id="w")
    with pytest.raises(CodecError, match=r"state\['model'\]\['w'\].*float32\[5, 4\]"):
        codec.load_into({"model": {"w": torch.zeros(5, 4)}}, m, data)
