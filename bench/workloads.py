"""Seeded benchmark workloads; every case of a run sees the very same bytes.

- W1: GPT-2-medium-shaped fp32 weights (24 layers, d=1024, vocab 50257, context 1024):
  292 tensors, 1.42 GB at ``scale=1``.
- W2: a real :class:`torch.nn.Module` (a stack of Linear + LayerNorm blocks) with materialised
  AdamW state after one optimizer step; params + exp_avg + exp_avg_sq = 12 bytes per parameter,
  ~4 GB at ``scale=1``.
- W3: 10,000 fp32 tensors of 16 KiB each (many-small-tensors stress) plus torch / numpy /
  python RNG states and a dataloader-like state dict.

``scale`` multiplies the bytes (the first dimension of every tensor) and keeps the tensor count,
so per-tensor overheads stay visible at small sizes. Values come from a seeded
:class:`torch.Generator`, so two runs with the same seed produce identical bytes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

SEED = 20240601

GPT2_MEDIUM = {"layers": 24, "d": 1024, "vocab": 50257, "ctx": 1024}


@dataclass
class Workload:
    """A named state dict plus its tensor inventory."""

    name: str
    description: str
    state: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def count(self) -> int:
        return len(self.tensors)

    def flat_tensors(self) -> dict[str, torch.Tensor]:
        """``{dotted.path: tensor}`` of every tensor (for safetensors / flat formats)."""
        return dict(_walk_tensors(self.state, ""))


def _walk_tensors(node: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield prefix, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _walk_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _walk_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def _scaled(dim: int, scale: float) -> int:
    return max(1, round(dim * scale))


def _fill(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # uniform_ is ~3x faster than randn on CPU and the bytes are just as incompressible.
    return torch.empty(shape, dtype=torch.float32).uniform_(-1.0, 1.0, generator=gen)


def gpt2_medium_shapes(scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of GPT-2 medium's parameters (HF naming); first dims scaled."""
    d, v, ctx = GPT2_MEDIUM["d"], GPT2_MEDIUM["vocab"], GPT2_MEDIUM["ctx"]
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("wte.weight", (v, d)),
        ("wpe.weight", (ctx, d)),
    ]
    for i in range(GPT2_MEDIUM["layers"]):
        p = f"h.{i}"
        shapes += [
            (f"{p}.ln_1.weight", (d,)),
            (f"{p}.ln_1.bias", (d,)),
            (f"{p}.attn.c_attn.weight", (d, 3 * d)),
            (f"{p}.attn.c_attn.bias", (3 * d,)),
            (f"{p}.attn.c_proj.weight", (d, d)),
            (f"{p}.attn.c_proj.bias", (d,)),
            (f"{p}.ln_2.weight", (d,)),
            (f"{p}.ln_2.bias", (d,)),
            (f"{p}.mlp.c_fc.weight", (d, 4 * d)),
            (f"{p}.mlp.c_fc.bias", (4 * d,)),
            (f"{p}.mlp.c_proj.weight", (4 * d, d)),
            (f"{p}.mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return [(n, (_scaled(s[0], scale), *s[1:])) for n, s in shapes]


def make_w1(scale: float = 1.0, seed: int = SEED) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    weights = {name: _fill(shape, gen) for name, shape in gpt2_medium_shapes(scale)}
    w = Workload(
        "W1",
        f"GPT-2-medium-shaped fp32 weights (scale {scale:g})",
        {"model": weights},
        list(weights.values()),
    )
    return w


class _Block(torch.nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


def make_w2(scale: float = 1.0, seed: int = SEED) -> Workload:
    """An MLP stack with AdamW state after one real optimizer step (12 bytes per parameter).

    At scale 1: 10 blocks of d=2048, hidden=8192 -> 336 M parameters -> 4.0 GB of state.
    """
    torch.manual_seed(seed)
    d, hidden = 2048, _scaled(8192, scale)
    blocks = 10
    model = torch.nn.Sequential(*[_Block(d, hidden) for _ in range(blocks)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One real step with a cheap surrogate gradient (a backward pass through 336 M parameters
    # takes minutes on two cores and writes exactly the same kind of state).
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = _fill(tuple(p.shape), gen)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    tensors = [t for _, t in _walk_tensors(state, "")]
    return Workload(
        "W2",
        f"nn.Module ({blocks}x Linear/LayerNorm blocks) + AdamW state after one step "
        f"(scale {scale:g})",
        state,
        tensors,
    )


def make_w3(count: int = 10_000, tensor_bytes: int = 16 * 1024, seed: int = SEED) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    n = tensor_bytes // 4
    tensors = {f"t{i:05d}": _fill((n,), gen) for i in range(count)}
    rnd = random.Random(seed)
    state = {
        "tensors": tensors,
        "rng": {
            "torch": torch.Generator().manual_seed(seed).get_state(),
            "numpy": np.random.default_rng(seed).bit_generator.state,
            "python": list(rnd.getstate()[1][:8]),
        },
        "dataloader": {"epoch": 3, "batch_index": 1234, "seed": seed, "shuffle": True},
        "step": 1000,
    }
    all_tensors = [t for _, t in _walk_tensors(state, "")]
    return Workload(
        "W3",
        f"{count} fp32 tensors of {tensor_bytes} B + RNG and dataloader state",
        state,
        all_tensors,
    )
