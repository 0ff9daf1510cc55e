"""The operator's bucket check (`check_bucket_reachable`) goes where the sidecar goes: the
policy's ``tiers.gcs.endpoint`` (a real fake-gcs-server, the real storage client), with
anonymous credentials for an ``http://`` emulator and no ``STORAGE_EMULATOR_HOST`` in the
operator's environment."""

from __future__ import annotations

import pytest

from strata.testing.emulator import free_port
from strata_operator.api.models import GcsTierSpec
from strata_operator.reconcile.facts import check_bucket_reachable
from strata_operator.reconcile.policy import parse_spec
from tests.fixtures.gcs import GcsEmulator
from tests.fixtures.policies import PolicyBuilder

pytestmark = pytest.mark.integration


def _gcs(bucket: str, endpoint: str) -> GcsTierSpec:
    spec = parse_spec(PolicyBuilder().gcs(bucket, endpoint=endpoint).spec())
    assert spec.tiers.gcs is not None
    return spec.tiers.gcs


@pytest.fixture(autouse=True)
def _no_emulator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)


def test_the_bucket_behind_the_policys_endpoint_is_found(
    gcs_emulator: GcsEmulator, gcs_bucket: str
) -> None:
    fact = check_bucket_reachable(_gcs(gcs_bucket, gcs_emulator.endpoint), None, timeout=10)
    assert fact.outcome == "ok", fact


def test_a_missing_bucket_behind_the_endpoint_is_not_found(gcs_emulator: GcsEmulator) -> None:
    fact = check_bucket_reachable(_gcs("strata-no-such-bucket", gcs_emulator.endpoint), None)
    assert fact.outcome == "not-found", fact


def test_an_endpoint_nobody_listens_on_is_unreachable() -> None:
    fact = check_bucket_reachable(
        _gcs("strata-any", f"http://127.0.0.1:{free_port('127.0.0.1')}"), None, timeout=3
    )
    assert fact.outcome == "unreachable", fact
