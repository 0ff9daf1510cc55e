"""Resharding by default (issue 29): the policy's options, the per-rank values of a saved step
(from its manifests' trees), and the step every rank picks from the gathered reshard sources."""

from __future__ import annotations

from typing import Any

import pytest

from strata.errors import ConfigError, RestoreError
from strata.format.incarnation import Incarnation
from strata.format.manifest import Manifest
from strata.restore.reshard import (
    PER_RANK_RULE,
    ReshardPolicy,
    ReshardRefused,
    per_rank_values,
    pick_reshard,
    refusal,
)

pytestmark = pytest.mark.unit
ORDER = ("ram", "pvc", "gcs")


def policy(reshard: bool | None = None, per_rank: bool | None = None, **env: str) -> ReshardPolicy:
    return ReshardPolicy.from_options(reshard, per_rank, env)


def test_default_is_auto_without_a_per_rank_rule() -> None:
    assert policy() == ReshardPolicy("auto", False)
    assert policy().enabled


def test_reshard_true_and_the_old_env_var_keep_their_meaning_reshard_with_the_per_rank_rule() -> (
    None
):
    assert policy(True) == ReshardPolicy("auto", True)
    assert policy(STRATA_RESTORE_RESHARD="1") == ReshardPolicy("auto", True)
    # an explicit per-rank choice wins over the old opt-in's implied one
    assert policy(True, False) == ReshardPolicy("auto", False)


def test_reshard_false_and_env_zero_turn_it_off() -> None:
    assert not policy(False).enabled
    assert not policy(STRATA_RESTORE_RESHARD="0").enabled
    # the argument wins over the environment
    assert policy(None, None, STRATA_RESTORE_RESHARD="0", STRATA_RESTORE_RESHARD_PER_RANK="") == (
        ReshardPolicy("off", False)
    )
    assert policy(True, None, STRATA_RESTORE_RESHARD="0").enabled


def test_per_rank_option_from_argument_and_env() -> None:
    assert policy(None, True) == ReshardPolicy("auto", True)
    assert policy(STRATA_RESTORE_RESHARD_PER_RANK="true") == ReshardPolicy("auto", True)


def test_conflicting_options_and_bad_env_values_are_config_errors_naming_them() -> None:
    with pytest.raises(ConfigError, match="reshard=False conflicts with reshard_per_rank=True"):
        policy(False, True)
    with pytest.raises(ConfigError, match="STRATA_RESTORE_RESHARD_PER_RANK='maybe'"):
        policy(STRATA_RESTORE_RESHARD_PER_RANK="maybe")
    with pytest.raises(ConfigError, match="'auto' or 'off'"):
        ReshardPolicy("always")  # type: ignore[arg-type]


def manifest(rank: int, tree: Any, world: int = 4) -> Manifest:
    return Manifest(
        job_id="ns.j",
        step=7,
        rank=rank,
        world_size=world,
        writer_id="w",
        tree=tree,
        tensors=[],
        storages=[],
        data_nbytes=0,
    )


def test_global_tensors_and_equal_values_are_not_per_rank() -> None:
    trees = [
        {
            "model": {"w": {"__sharded__": 0}, "b": {"__sharded__": 1}},
            "step": 7,
            "optim": {"param_groups": [{"lr": {"__float__": "0.01"}, "params": [0, 1]}]},
            "cfg": {"__tuple__": [1, "a"]},
        }
        for _ in range(4)
    ]
    got = per_rank_values([manifest(r, t) for r, t in enumerate(trees)])
    assert got.blocking == []


def test_plain_tensors_and_values_that_differ_between_ranks_are_per_rank() -> None:
    trees = [
        {
            "model": {"w": {"__sharded__": 0}},
            "rng": {"__tensor__": 0},
            "loader": {"epoch": 3, "offset": 100 * r},
            "extra": {"k": 1} if r == 2 else {},
            "odict": {"__dict__": [[1, {"__tensor__": 1}]], "type": "OrderedDict"},
        }
        for r in range(4)
    ]
    got = per_rank_values([manifest(r, t) for r, t in enumerate(trees)])
    assert got.tensors == ["state['odict'][1]", "state['rng']"]
    assert got.differing == ["state['extra']['k']", "state['loader']['offset']"]
    err = refusal(7, 4, 2, got)
    assert isinstance(err, RestoreError) and isinstance(err, ReshardRefused)
    msg = str(err)
    for needle in (
        "state['rng']",
        "state['loader']['offset']",
        "reshard_per_rank=True",
        "STRATA_RESTORE_RESHARD_PER_RANK=1",
        "reshard=False",
        PER_RANK_RULE,
        "world size 4",
    ):
        assert needle in msg, needle
    assert err.blocking == got.blocking and (err.step, err.saved_world_size) == (7, 4)


def inc(id_: str, parent: str | None, base: int | None, world: int) -> dict[str, Any]:
    return Incarnation(
        job_id="ns.j",
        id=id_,
        parent=parent,
        base_step=base,
        world_size=world,
        created=f"2026-12-0{id_[-1]}T00:00:00+00:00",
    ).model_dump(mode="json")


def src(step: int, tier: str, world: int = 4, inc_id: str = "i1") -> dict[str, Any]:
    return {"step": step, "world_size": world, "incarnation": inc_id, "tier": tier}


def test_a_shared_tier_serves_every_rank_and_the_newest_step_wins() -> None:
    recs = [inc("i1", None, None, 4)]
    g = [
        {"rank": 0, "sources": [src(10, "pvc"), src(20, "gcs")], "records": recs},
        {"rank": 1, "sources": [src(10, "pvc"), src(20, "gcs")], "records": recs},
    ]
    c = pick_reshard(g, 2, ORDER)
    assert c is not None and (c.step, c.saved_world_size, c.incarnation) == (20, 4, "i1")
    assert c.sources == {0: ("gcs",), 1: ("gcs",)}
    pinned = pick_reshard(g, 2, ORDER, step=10)
    assert pinned is not None and pinned.sources == {0: ("pvc",), 1: ("pvc",)}
    assert pick_reshard(g, 2, ORDER, step=11) is None


def test_a_ram_source_serves_only_the_ranks_that_reported_it() -> None:
    # rank 0's node holds every shard of step 30 in RAM; rank 1's node does not
    rank1 = [src(20, "pvc")]
    g: list[dict[str, Any]] = [
        {"rank": 0, "sources": [src(30, "ram"), src(20, "pvc")], "records": []},
        {"rank": 1, "sources": rank1, "records": []},
    ]
    c = pick_reshard(g, 2, ORDER)
    assert c is not None and c.step == 20 and c.sources == {0: ("pvc",), 1: ("pvc",)}
    rank1.append(src(30, "ram"))  # both ranks on the node that holds it
    c = pick_reshard(g, 2, ORDER)
    assert c is not None and c.step == 30 and c.sources == {0: ("ram",), 1: ("ram",)}
    # without torch.distributed only this rank's report is there: other ranks need shared tiers
    only = pick_reshard(g[:1], 2, ORDER)
    assert only is not None and only.step == 20


def test_superseded_steps_and_steps_of_this_world_size_are_never_picked() -> None:
    # i2 resumed from step 10 of i1: i1's step 20 is superseded; i2 wrote step 15 at world 2
    recs = [inc("i1", None, None, 4), inc("i2", "i1", 10, 2)]
    g = [
        {
            "rank": 0,
            "sources": [src(20, "pvc"), src(10, "pvc"), src(15, "pvc", 2, "i2")],
            "records": recs,
        }
    ]
    c = pick_reshard(g, 1, ORDER)
    assert c is not None and (c.step, c.incarnation, c.saved_world_size) == (15, "i2", 2)
    c = pick_reshard(g, 2, ORDER)
    assert c is not None and (c.step, c.incarnation) == (10, "i1")
