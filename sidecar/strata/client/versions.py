"""Tensor version counters and optimizers: how an overlapped save notices a state that changed.

``torch.Tensor._version`` goes up with every in-place change. An overlapped save
(:mod:`strata.client.saver`) reads the counters of every live tensor when it enqueues the
copies and again when they complete (:func:`check_unchanged`); a tensor changed in between
makes that step not committed. :class:`OptimizerHooks` makes every ``torch.optim.Optimizer``
of a state wait for the copy before its step.

Both hold for compiled training steps: a ``torch.compile``d ``optimizer.step`` still runs the
pre-hook, and in-place updates from AOTAutograd and Inductor graphs (CPU code generation) move
the counters (``tests/integration/test_compiled_state.py``). CUDA graph replays
(``mode="reduce-overhead"``) bypass the dispatcher and have not been run against this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from strata.errors import StateChanged


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference-mode tensors have no version counter
        return -1


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """``_version`` of each tensor (-1 where it has none): one comprehension, the per-tensor
    function call only when some tensor has no counter (bench W3: 10,000 tensors)."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference-mode tensor
        return [_version(t) for t in tensors]


def check_unchanged(tensors: list[torch.Tensor], before: list[int], step: int) -> None:
    """Raise :class:`StateChanged` when a tensor's counter moved since ``before`` (read when the
    overlapped save of ``step`` enqueued its copies)."""
    now = versions(tensors)
    changed = [i for i, (n, v) in enumerate(zip(now, before, strict=True)) if v >= 0 and n != v]
    if changed:
        raise StateChanged(
            f"{len(changed)} tensor(s) of the state changed in place while an "
            f"overlapped save of step {step} was copying them, so that step is not "
            "committed; call wait_copied() (or let optimizer.step() do it) before "
            "changing the state"
        )


def optimizers(state: Any, depth: int = 0) -> list[torch.optim.Optimizer]:
    """Optimizers in the state tree (dicts, lists, tuples; a few levels deep)."""
    if isinstance(state, torch.optim.Optimizer):
        return [state]
    if depth > 3 or isinstance(state, torch.Tensor):
        return []
    if isinstance(state, dict):
        values: Any = state.values()
    elif isinstance(state, (list, tuple)):
        values = state
    else:
        return []
    return [o for v in values for o in optimizers(v, depth + 1)]


class OptimizerHooks:
    """Step pre-hooks calling ``before_step()`` on every optimizer of the states hooked (each
    optimizer once)."""

    def __init__(self, before_step: Callable[[], object]) -> None:
        self.before_step = before_step
        self._hooked: dict[int, Any] = {}

    def hook(self, state: Any) -> None:
        for opt in optimizers(state):
            if id(opt) not in self._hooked:
                self._hooked[id(opt)] = opt.register_step_pre_hook(self._pre_hook)

    def _pre_hook(self, *_args: Any, **_kw: Any) -> None:
        self.before_step()

    def remove(self) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
