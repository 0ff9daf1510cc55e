"""Whether a durable tier can hold ``keep + 1`` steps: :class:`CapacityWatch`.

After a step failed with no space left on a tier: when the tier holds no more than ``keep``
complete older steps, retention can free nothing (it never deletes the newest complete steps
before a newer one is complete), so the tier is too small for ``keep + 1`` steps and promotion
to it has stopped for good. The watch says so once per reason (ERROR log, a ``too_small``
event for metrics and reports, :attr:`CapacityWatch.too_small`) and clears it when the tier
takes steps again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from strata.config import TierName
from strata.errors import TierError
from strata.format.manifest import Manifest
from strata.sidecar.promotion.events import PromotionEvent
from strata.sidecar.promotion.policies import TierPolicy
from strata.tiers.base import Tier

log = logging.getLogger("strata.promotion")


class CapacityWatch:
    """Capacity of the tiers ``durable`` of ``job_id`` under their ``policies``' retention;
    ``emit``: ``too_small`` events (message "" when the tier fits again)."""

    def __init__(
        self,
        job_id: str,
        durable: Mapping[TierName, Tier],
        policies: Mapping[TierName, TierPolicy],
        emit: Callable[[PromotionEvent], None],
    ) -> None:
        self.job_id = job_id
        self.durable = durable
        self.policies = policies
        self._emit = emit
        self.too_small: dict[TierName, str] = {}
        """Tier -> why it cannot take keep + 1 steps."""

    def fits(self, name: TierName, step: int) -> None:
        """``step`` was placed in ``name``: a tier said to be too small takes steps again."""
        if self.too_small.pop(name, None) is not None:
            log.info("the %s tier takes steps again", name, extra={"event": "tier_fits"})
            self._emit(PromotionEvent("too_small", name, step, message=""))

    def check(self, name: TierName, step: int, manifests: dict[int, Manifest]) -> None:
        """``step`` (its local ``manifests``) failed with no space left on ``name``: say whether
        the tier is too small for ``keep + 1`` steps (see the module docstring)."""
        tier = self.durable[name]
        retention = self.policies[name].retention
        try:
            older = [s for s in tier.complete_steps(self.job_id) if s < step]
        except TierError:
            return
        if retention.to_delete(older):
            return  # retention still has something to delete
        keep = retention.keep if retention.keep is not None else len(older)
        m = next(iter(manifests.values()))
        shard = max(mm.data_nbytes for mm in manifests.values())
        step_bytes = shard * m.world_size
        have = ""
        root = tier.local_root()
        if root is not None:
            try:
                st = os.statvfs(root)
                have = f"; the volume holds {st.f_blocks * st.f_frsize} bytes"
            except OSError:
                pass
        why = (
            f"the {name} tier is too small for keep + 1 = {keep + 1} steps of about "
            f"{step_bytes} bytes each (step {step} did not fit next to {len(older)} complete "
            f"older step(s) that retention keeps){have}; promotion to it is stuck. Enlarge the "
            f"volume to at least {(keep + 1) * step_bytes} bytes or lower {name}.keep"
        )
        if self.too_small.get(name) != why:
            log.error(why, extra={"event": "tier_too_small", "tier": name, "step": step})
        self.too_small[name] = why
        self._emit(PromotionEvent("too_small", name, step, message=why))
