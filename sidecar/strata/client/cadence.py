"""Components at their own cadence: a slow top-level component of the state (EMA
weights, a teacher) is snapshotted every ``K`` steps and carried unchanged in between.

:class:`ComponentCadence` gives the saver the state to encode: at a step where the component is
due (``step % K == 0``, or nothing held yet) a CPU copy of it is taken and held; at other steps
the held copy stands in for it. Every save still holds the whole state (a RAM restore needs
nothing else), and since the held tensors do not change, the promotion stores their bytes once
(incremental copies, :mod:`strata.format.incremental`). The manifest records from which step
each slow component comes (``Manifest.component_steps``) and ``Checkpointer.restore`` reports it
(``RestoreResult.component_steps``): restoring step ``S`` gives the component as of that step.

Cost: at a due step the component is copied twice on the training thread (to the held copy,
then into the slot); memory: one CPU copy of each slow component.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch


def _hold(obj: Any) -> Any:
    """A CPU copy of ``obj`` (tensors copied, containers rebuilt, state_dict owners by their
    ``state_dict()``) that training does not touch."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return _hold(obj.state_dict())
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and e.g. state_dict()'s _metadata
        for k, v in obj.items():
            out[k] = _hold(v)
        return out
    if isinstance(obj, list):
        return [_hold(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_hold(v) for v in obj)
    return copy.deepcopy(obj)


class ComponentCadence:
    """``every``: top-level key of the state dict -> steps between its snapshots (>= 1).

    Raises ValueError for a non-positive interval.
    """

    def __init__(self, every: Mapping[str, int]) -> None:
        bad = {k: v for k, v in every.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"component_every needs positive step counts, got {bad}")
        self.every = dict(every)
        self._held: dict[str, tuple[int, Any]] = {}

    def forget(self) -> None:
        """Drop the held copies (after a restore: the next save snapshots afresh)."""
        self._held.clear()

    def apply(self, step: int, state: Any) -> tuple[Any, dict[str, int] | None]:
        """(state to encode, component -> step its bytes come from); ``state`` is returned as
        is when it is not a dict or holds none of the slow components."""
        if not isinstance(state, dict):
            return state, None
        out = None
        steps: dict[str, int] = {}
        for name, k in self.every.items():
            if name not in state:
                continue
            held = self._held.get(name)
            if held is None or step % k == 0 or step < held[0]:
                held = (step, _hold(state[name]))
                self._held[name] = held
            if out is None:
                out = dict(state)
            out[name] = held[1]
            steps[name] = held[0]
        return (state, None) if out is None else (out, steps)
