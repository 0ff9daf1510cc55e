"""Operator wiring that needs no cluster: kopf's diff base and the command line."""

from __future__ import annotations

import kopf
import pytest

from strata_operator import main

pytestmark = pytest.mark.unit


def _body(generation: int, claim: str) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "strata.dev/v1alpha1",
            "kind": "CheckpointPolicy",
            # An API object carries more metadata than RawMeta declares.
            "metadata": {"name": "p", "namespace": "ns", "generation": generation},  # type: ignore[typeddict-unknown-key]
            "spec": {"tiers": {"pvc": {"claimName": claim}}},
            "status": {"observedGeneration": generation - 1},
        }
    )


def test_a_reverted_spec_is_still_a_change_for_kopf() -> None:
    storage = main.GenerationDiffBaseStorage(prefix="strata.dev", key="last-handled-configuration")
    handled = storage.build(body=_body(1, "ckpt"))
    reverted = storage.build(body=_body(3, "ckpt"))
    assert handled != reverted
    assert reverted["spec"] == handled["spec"]
    assert "status" not in reverted


def test_command_line_flags() -> None:
    args = main.build_parser().parse_args(
        [
            "-n",
            "team-a",
            "-n",
            "team-b",
            "--liveness",
            "http://127.0.0.1:8090/healthz",
            "--dependency-retry",
            "5",
            "--no-bucket-check",
        ]
    )
    assert args.namespace == ["team-a", "team-b"]
    assert args.liveness == "http://127.0.0.1:8090/healthz"
    assert args.dependency_retry == 5.0 and args.no_bucket_check is True
    with pytest.raises(SystemExit):
        main.build_parser().parse_args(["-n", "a", "-A"])
