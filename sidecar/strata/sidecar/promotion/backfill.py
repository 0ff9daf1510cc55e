"""Back-fill: a live step of an earlier incarnation that a faster durable tier holds but a slower
one lacks is copied there by whichever sidecar runs now.

Why: a sidecar promotes its own RAM steps only. When a node dies after its shards of step S
reached the PVC but before they reached GCS, the replacement pod's sidecar never had S in RAM,
so without back-fill S would never reach GCS although it is live (the job may even have resumed
from it): losing the PVC would then lose S for good.

Which steps (:func:`backfill_steps`, pure): steps *eligible* in the source tier
(:mod:`strata.tiers.eligible`: committed and live), written by an incarnation other than the
current one (the current incarnation's own steps follow the destination's interval), not
archive-only, not eligible in the destination already (never re-uploaded), and that retention
would keep in the destination: among the newest ``keep`` of the destination's eligible steps
together with the candidates. So back-fill costs at most ``keep`` steps per destination, once.

Who copies what: each sidecar copies the shards of its local ranks (below the step's world
size); ranks that no sidecar of the current world serves (the step was written at a larger world
size) are copied by the step's designated commit writer
(:func:`strata.sidecar.promotion.committer.commit_writer_rank`). The commit record in the
destination is then written like any other (designated writer, takeover), for the step's own
incarnation, with that incarnation's records copied first.
"""

from __future__ import annotations

from collections.abc import Mapping

from strata.format.commit import StepCommit
from strata.sidecar.promotion.policies import RetentionPolicy


def backfill_steps(
    source: Mapping[int, StepCommit],
    destination: Mapping[int, StepCommit],
    retention: RetentionPolicy,
    current: str | None,
) -> list[int]:
    """The steps to back-fill into the destination, newest first (see the module docstring).

    ``source`` / ``destination``: eligible steps (step -> commit record) of the faster tier and
    of the destination; ``retention``: the destination's; ``current``: the current incarnation
    (None: unknown, nothing is back-filled)."""
    if current is None:
        return []
    candidates = {
        s
        for s, c in source.items()
        if s not in destination and c.incarnation != current and not c.archive_only
    }
    if not candidates:
        return []
    dropped = set(retention.to_delete(set(destination) | candidates))
    return sorted(candidates - dropped, reverse=True)
