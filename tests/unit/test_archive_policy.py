"""Issue 18 policy fields: archive tiers (components) and incremental copies, from the
CheckpointPolicy to the StrataConfig the webhook injects."""

from __future__ import annotations

import pytest

from strata.config import StrataConfig
from strata.errors import ConfigError
from strata_operator import api
from strata_operator.reconcile.policy import parse_spec
from strata_operator.sidecar_config import to_sidecar_config
from tests.fixtures.policies import PolicyBuilder


def test_components_and_incremental_reach_the_sidecar_config() -> None:
    spec = parse_spec(
        PolicyBuilder().pvc(incremental=False).gcs(components=["model", "ema"]).spec()
    )
    cfg = to_sidecar_config(spec, "ns.job")
    assert cfg.pvc is not None and cfg.pvc.incremental is False and cfg.pvc.components is None
    assert cfg.gcs is not None and cfg.gcs.components == ("model", "ema")
    assert cfg.gcs.incremental is True
    assert cfg.archive_tiers() == {"gcs": ("model", "ema")}
    # the archive tier never resumes training
    assert cfg.tiers_in_restore_order() == ["ram", "pvc"]
    assert StrataConfig.from_env(cfg.to_env()) == cfg


def test_the_client_refuses_an_archive_tier_first_like_the_crd() -> None:
    with pytest.raises(ConfigError, match="archive tier"):
        StrataConfig.parse(
            {
                "job_id": "ns.job",
                "pvc": {"components": ["model"]},
                "restore": {"order": ["pvc", "ram"]},
            }
        )
    assert api.RULE_ARCHIVE_NOT_FIRST.message.startswith("restore.order must not start")


def test_projection_uses_the_codecs_tensor_tag() -> None:
    from strata.format import codec, projection

    assert projection.TENSOR_TAG == codec.TENSOR_TAG


def test_component_cadence_reaches_the_client_config() -> None:
    spec = parse_spec(PolicyBuilder().set("componentEvery", {"ema": 100}).spec())
    cfg = to_sidecar_config(spec, "ns.job")
    assert cfg.component_every == {"ema": 100}
    assert StrataConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ConfigError, match="component_every"):
        StrataConfig.parse({"job_id": "ns.job", "component_every": {"ema": 0}})
