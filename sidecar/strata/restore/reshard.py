"""Resharding restores: when a step written at another world size is restored, from which tiers,
and what happens to the values that belong to one rank.

A restore at world size ``W`` reshards step ``S`` written at world size ``W'`` != ``W`` when
``S`` is newer than every step restorable at ``W`` and the :class:`ReshardPolicy` allows it.
The default policy (``"auto"``) reshards exactly when the saved state says how:

- every tensor is described globally: a DTensor (any mesh, any placements) or a plain tensor
  declared replicated at save time (``save(replicated=...)``); each is stored once per chunk
  with its global shape and placement, so any world size can take the slices it needs;
- every *per-rank value* has a stated rule. A non-tensor value (an int, a string, optimizer
  ``param_groups``) that is equal on every saved rank is the same everywhere and is restored as
  saved. A plain tensor not declared replicated (``torch.get_rng_state()``) and a non-tensor
  value that differs between saved ranks (dataloader positions) belong to one rank: they have
  no rule by default and the restore raises :class:`ReshardRefused` naming them and the option
  that accepts :data:`PER_RANK_RULE` for them (``reshard_per_rank=True`` /
  ``STRATA_RESTORE_RESHARD_PER_RANK=1``).

The check reads only manifests (the tree of every saved rank), never tensor bytes; it runs
before anything is loaded into the live state.

Reshard sources (:func:`reshard_sources`): a tier is a source of step ``S`` for a rank when it
holds every shard of one committed copy of ``S`` of one incarnation: a shared tier (PVC, GCS)
with a global commit record that verifies and whose shards are all there (only the commit
records of steps of other world sizes are read), or this node's RAM tier when it holds every
rank's checksummed shard of one incarnation (several ranks of one pod), or the peer tier when
the job's other nodes hold, between their RAM tiers and the copies they keep for their peers
(replicas, erasure-coded parity), every rank's checksummed shard of one incarnation: checked
like RAM, by every rank's manifest, since peers keep no commit records. The ranks all-gather
their sources and :func:`pick_reshard` (pure) chooses the same step on every rank: the newest
step of the live lineage (incarnation records, :class:`strata.format.incarnation.Lineage`) for
which every rank of this world has a source; a RAM or peer source serves only the ranks that
reported it (what a node's peers hold differs from node to node: its own RAM is not among
them).

Sources: torch DCP and Orbax reshard DTensor / ``jax.Array`` state on load without being asked;
DCP also refuses to guess per-rank ``BytesIO`` entries at another world size.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from strata.constants import ENV_RESTORE_RESHARD, ENV_RESTORE_RESHARD_PER_RANK
from strata.errors import CommitError, ConfigError, RestoreError, TierError
from strata.format.incarnation import Incarnation, Lineage
from strata.format.manifest import Manifest
from strata.restore.inventory import list_tiers
from strata.tiers.base import Tier
from strata.tiers.eligible import tier_steps

log = logging.getLogger("strata.restore")

LOCAL_SOURCES: frozenset[str] = frozenset({"ram", "peer"})
"""Tiers whose content only the reporting rank (its node) can read: its RAM tier, and its peer
tier (the other nodes' copies as this node's sidecar reaches them)."""

PER_RANK_RULE = (
    "rank r takes the per-rank values of saved rank r; a rank beyond the saved world size those "
    "of saved rank r % saved world size; the per-rank values of saved ranks beyond the new world "
    "size are dropped (each case is noted in RestoreResult.skipped)"
)
"""The documented rule for per-rank values that ``reshard_per_rank`` accepts."""

_TRUE = ("1", "true", "True", "yes")
_FALSE = ("0", "false", "False", "no")


class ReshardRefused(RestoreError):
    """A step of another world size is the newest restorable one, but some of its values belong
    to one rank and no rule for them was accepted. ``blocking``: their paths in the state tree
    (``state['rng']``); ``step`` / ``saved_world_size``: the step refused. Every rank raises it
    alike, before the live state is touched."""

    def __init__(self, message: str, step: int, saved_world_size: int, blocking: list[str]):
        super().__init__(message)
        self.step = step
        self.saved_world_size = saved_world_size
        self.blocking = blocking


@dataclass(frozen=True)
class ReshardPolicy:
    """When :meth:`strata.Checkpointer.restore` reshards (see the module docstring).

    ``mode``: ``"auto"`` (default) reshards when the state allows it, ``"off"`` never (steps of
    another world size are skipped and noted). ``per_rank``: accept :data:`PER_RANK_RULE` for
    per-rank values (default False: such values refuse the restore). Raises
    :class:`strata.errors.ConfigError` for ``per_rank`` with ``mode="off"`` (a conflict).
    """

    mode: Literal["auto", "off"] = "auto"
    per_rank: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off"):
            raise ConfigError(f"reshard mode must be 'auto' or 'off', got {self.mode!r}")
        if self.mode == "off" and self.per_rank:
            raise ConfigError(
                "reshard=False conflicts with reshard_per_rank=True (or "
                f"{ENV_RESTORE_RESHARD_PER_RANK}=1): per-rank values only matter when resharding"
            )

    @property
    def enabled(self) -> bool:
        return self.mode == "auto"

    @classmethod
    def from_options(
        cls,
        reshard: bool | None,
        reshard_per_rank: bool | None,
        environ: Mapping[str, str] | None = None,
    ) -> ReshardPolicy:
        """The policy of ``Checkpointer(reshard=..., reshard_per_rank=...)``; None: from the
        environment (``STRATA_RESTORE_RESHARD``, ``STRATA_RESTORE_RESHARD_PER_RANK``), else the
        default. ``reshard=True`` (or ``STRATA_RESTORE_RESHARD=1``, the opt-in of earlier
        versions) keeps its meaning: reshard, per-rank values by :data:`PER_RANK_RULE`.
        ``reshard=False`` (or ``=0``) turns resharding off. Raises :class:`ConfigError` for a
        value of the variables that is not a boolean, and for the conflict above."""
        env = os.environ if environ is None else environ
        if reshard is None:
            reshard = _env_bool(env, ENV_RESTORE_RESHARD)
        if reshard_per_rank is None:
            reshard_per_rank = _env_bool(env, ENV_RESTORE_RESHARD_PER_RANK)
        if reshard is False:
            return cls("off", bool(reshard_per_rank))
        if reshard is True and reshard_per_rank is None:
            return cls("auto", True)
        return cls("auto", bool(reshard_per_rank))


def _env_bool(env: Mapping[str, str], name: str) -> bool | None:
    v = env.get(name, "")
    if v == "":
        return None
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={v!r}: expected 1/true or 0/false")


# -- the values of one rank ---------------------------------------------------------------------


@dataclass(frozen=True)
class PerRankValues:
    """The values of a saved step that belong to one rank (:func:`per_rank_values`)."""

    tensors: list[str] = field(default_factory=list)
    """Paths of plain tensors not declared replicated (stored per rank, no global layout)."""
    differing: list[str] = field(default_factory=list)
    """Paths of non-tensor values that differ between saved ranks (or exist on some only)."""

    @property
    def blocking(self) -> list[str]:
        return self.tensors + self.differing


def per_rank_values(manifests: Sequence[Manifest]) -> PerRankValues:
    """The per-rank values of one step from the manifests of every saved rank (any order).

    Pure: reads the manifests' trees only. A tree node ``{"__tensor__": i}`` is a plain tensor
    (per rank); ``{"__sharded__": i}`` a tensor described globally (never per rank); any other
    leaf is compared as JSON across the ranks. Paths are the codec's (``state['optim'][0]``).
    """
    leaves: list[dict[str, Any]] = []
    for m in manifests:
        out: dict[str, Any] = {}
        _leaves(m.tree, "state", out)
        leaves.append(out)
    tensors: set[str] = set()
    differing: set[str] = set()
    paths = sorted({p for lv in leaves for p in lv})
    for p in paths:
        vals = [lv.get(p, _MISSING) for lv in leaves]
        if any(v is _TENSOR for v in vals):
            tensors.add(p)
        elif any(v != vals[0] for v in vals[1:]):
            differing.add(p)
    return PerRankValues(sorted(tensors), sorted(differing))


_MISSING = object()
_TENSOR = object()


def _leaves(node: Any, path: str, out: dict[str, Any]) -> None:
    """Fill ``out`` with path -> canonical JSON of each leaf (:data:`_TENSOR` for a plain
    tensor); globally described tensors are left out."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            _leaves(v, f"{path}[{i}]", out)
        return
    if not isinstance(node, dict):
        out[path] = json.dumps(node, sort_keys=True)
        return
    tag = next(iter(node), None)
    if tag is None or not tag.startswith("__"):
        for k, v in node.items():
            _leaves(v, f"{path}[{k!r}]", out)
        return
    if tag == "__tensor__":
        out[path] = _TENSOR
    elif tag == "__sharded__":
        return
    elif tag == "__tuple__":
        for i, v in enumerate(node[tag]):
            _leaves(v, f"{path}[{i}]", out)
    elif tag == "__dict__":
        for k_node, v_node in node[tag]:
            _leaves(v_node, f"{path}[{json.dumps(k_node, sort_keys=True)}]", out)
    else:
        out[path] = json.dumps(node, sort_keys=True)


def refusal(step: int, saved_world: int, world_size: int, values: PerRankValues) -> ReshardRefused:
    """The :class:`ReshardRefused` for ``values`` (non-empty) of ``step``."""
    blocking = values.blocking
    parts = []
    if values.tensors:
        parts.append(f"plain tensors not declared replicated: {_some(values.tensors)}")
    if values.differing:
        parts.append(f"values that differ between saved ranks: {_some(values.differing)}")
    return ReshardRefused(
        f"step {step} was written at world size {saved_world} and is the newest restorable step; "
        f"restoring it at world size {world_size} means resharding, and these per-rank values "
        f"have no rule by default: {'; '.join(parts)}. Set Checkpointer(reshard_per_rank=True) "
        f"(or {ENV_RESTORE_RESHARD_PER_RANK}=1) to accept the documented rule ({PER_RANK_RULE}); "
        "or declare plain tensors that are equal on every rank with save(replicated=...) before "
        f"the next save; or pass reshard=False ({ENV_RESTORE_RESHARD}=0) to restore the newest "
        f"step written at world size {world_size} instead",
        step,
        saved_world,
        blocking,
    )


def _some(paths: list[str], n: int = 8) -> str:
    more = f" and {len(paths) - n} more" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more


# -- sources --------------------------------------------------------------------------------------


def reshard_sources(
    tiers: Sequence[Tier], job_id: str, rank: int, world_size: int, shared: bool = True
) -> dict[str, Any]:
    """What this rank (``rank`` of ``world_size``) can reshard from: plain builtins, for the
    ``reshard-candidate`` all-gather and :func:`pick_reshard`.

    ``{"rank": r, "sources": [{"step", "world_size", "incarnation", "tier"}, ...],
    "records": [incarnation records as JSON-mode dicts]}``: one entry per tier holding every
    shard of a committed copy of a step written at another world size (see the module
    docstring). Shared tiers: only the commit records of steps listed with another world size
    are read, and a step is a source only when :func:`strata.tiers.eligible.tier_steps` calls
    it eligible (committed and live in the lineage of the records found); a bad or stale record,
    a dead step, or an archive-only copy, is no source. RAM and the peer tier: the step's
    manifests (local files; from the peers, one request per rank) must all be checksummed, of
    one live incarnation and world size. A tier
    that cannot be listed is skipped (logged). Never raises for a tier's failure.
    ``shared=False``: list this node's RAM tier only (a shared tier's sources serve every rank,
    so with torch.distributed one rank lists them for all: one listing of GCS, not one per rank).
    """
    sources: list[dict[str, Any]] = []
    listed = list_tiers(
        [t for t in tiers if shared or t.name in LOCAL_SOURCES],
        job_id,
        lambda tier, exc: log.info("reshard sources: %s not searched: %s", tier.name, exc),
    )
    listings, records, lin = listed.steps, listed.records, listed.lineage()
    for tier in tiers:
        if tier.name not in listings:
            continue
        other = {
            s: e
            for s, e in listings[tier.name].items()
            if e.world_size is not None and e.world_size != world_size
        }
        if not other:
            continue
        try:
            if tier.name in LOCAL_SOURCES:
                found_here = [
                    (s, w, inc)
                    for s, w, inc in _every_manifest_sources(tier, job_id, other)
                    if lin.live(inc, s)
                ]
            else:
                # The one step rule (strata.tiers.eligible): committed and live.
                eligible = tier_steps(
                    tier,
                    job_id,
                    lin,
                    [s for s, e in other.items() if e.has_commit],
                    resumable=True,
                ).eligible
                found_here = [
                    (s, c.world_size, c.incarnation)
                    for s, c in eligible.items()
                    if c.world_size != world_size
                ]
        except (TierError, OSError) as exc:
            log.info("reshard sources: %s not searched: %s", tier.name, exc)
            continue
        for s, w, inc in found_here:
            sources.append({"step": s, "world_size": w, "incarnation": inc, "tier": tier.name})
    return {"rank": rank, "sources": sources, "records": list(records.values())}


def _every_manifest_sources(
    tier: Tier, job_id: str, listing: Mapping[int, Any]
) -> list[tuple[int, int, str]]:
    """(step, world size, incarnation) of the listed steps whose every rank's manifest ``tier``
    serves, checksummed, of one incarnation and world size, not archive-only."""
    out = []
    for step, entry in listing.items():
        w = entry.world_size
        if not set(range(w)) <= entry.committed_ranks:
            continue
        incs = set()
        for r in range(w):
            try:
                m = tier.get_manifest(job_id, step, r)
            except (TierError, CommitError):
                break
            if not m.verified or m.components is not None or m.world_size != w:
                break
            incs.add(m.incarnation)
        else:
            if len(incs) == 1:
                out.append((step, w, incs.pop()))
    return out


@dataclass(frozen=True)
class ReshardChoice:
    """The step every rank reshards: written at ``saved_world_size`` by ``incarnation``;
    ``sources``: per rank of this world, the tiers it reads (in restore order); ``lineage``: the
    one the step was chosen by (the new incarnation's record copies its chain)."""

    step: int
    saved_world_size: int
    incarnation: str
    sources: Mapping[int, tuple[str, ...]]
    lineage: Lineage = field(default_factory=lambda: Lineage(()), compare=False)


def pick_reshard(
    gathered: Sequence[Mapping[str, Any]],
    world_size: int,
    order: Sequence[str],
    step: int | None = None,
) -> ReshardChoice | None:
    """The newest step of the live lineage that every rank 0..``world_size``-1 can reshard
    from (see the module docstring), or None. Pure: every rank given the same gathered
    :func:`reshard_sources` gets the same choice. ``order``: the tiers in restore order;
    ``step``: only that step. Ranks absent from ``gathered`` (no torch.distributed) are served
    by shared tiers only."""
    recs: dict[str, Incarnation] = {}
    for g in gathered:
        for d in g.get("records", ()):
            if d.get("id") in recs:  # parsed once, whichever ranks shipped it
                continue
            try:
                rec = Incarnation.model_validate(d)
            except ValueError:
                continue
            recs.setdefault(rec.id, rec)
    lineage = Lineage(recs.values())
    by_key: dict[tuple[int, str, int], dict[int | None, set[str]]] = {}
    for g in gathered:
        for src in g.get("sources", ()):
            key = (int(src["step"]), str(src["incarnation"]), int(src["world_size"]))
            tier = str(src["tier"])
            holder = int(g["rank"]) if tier in LOCAL_SOURCES else None
            by_key.setdefault(key, {}).setdefault(holder, set()).add(tier)
    for s, inc, w in sorted(by_key, key=lambda k: (k[0], k[1]), reverse=True):
        if (step is not None and s != step) or w == world_size or not lineage.live(inc, s):
            continue
        held = by_key[(s, inc, w)]
        shared = held.get(None, set())
        per_rank = {}
        for r in range(world_size):
            tiers = shared | held.get(r, set())
            per_rank[r] = tuple(t for t in order if t in tiers) + tuple(
                sorted(t for t in tiers if t not in order)
            )
        if all(per_rank.values()):
            return ReshardChoice(s, w, inc, per_rank, lineage)
    return None
