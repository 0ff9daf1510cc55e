"""CheckpointPolicy models: parsing, every invalid case rejected with a useful message, and the
mapping to the sidecar contract."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from strata.config import StrataConfig
from strata_operator import api
from strata_operator.api import validation
from strata_operator.reconcile.policy import InvalidSpec, parse_spec
from strata_operator.sidecar_config import to_sidecar_config
from tests.fixtures.policies import InvalidCase, PolicyBuilder, invalid_policies

pytestmark = pytest.mark.unit

CASES = list(invalid_policies())


def test_there_are_at_least_fifty_generated_invalid_policies() -> None:
    assert len(CASES) >= 50
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.kind for c in CASES} == {
        "type",
        "range",
        "format",
        "cross-field",
        "required",
        "unknown",
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_invalid_policy_is_rejected_with_a_message_naming_the_problem(
    case: InvalidCase,
) -> None:
    with pytest.raises(InvalidSpec) as err:
        parse_spec(case.spec)
    assert case.expect.lower() in err.value.message.lower()
    assert err.value.message.startswith("invalid spec: spec")


def test_camel_case_spec_parses_with_defaults() -> None:
    spec = parse_spec(PolicyBuilder().pvc("ckpt", steps=100).gcs("my-ckpts", steps=1000).spec())
    assert spec.tiers.ram.size_limit == "64Mi"
    assert spec.tiers.ram.medium == "Memory"
    assert spec.tiers.ram.every.steps == 10
    assert spec.tiers.pvc is not None and spec.tiers.pvc.claim_name == "ckpt"
    assert spec.tiers.pvc.keep == 2
    assert spec.tiers.gcs is not None and spec.tiers.gcs.credentials.type == "WorkloadIdentity"
    assert spec.restore.verify is True and spec.restore.allow_fresh_start is False
    assert spec.configured_tiers() == ["ram", "pvc", "gcs"]


def test_models_are_frozen_and_dump_back_to_kubernetes_json() -> None:
    raw = PolicyBuilder().pvc("ckpt", steps=100, subPath="runs/a").spec()
    spec = parse_spec(raw)
    with pytest.raises(ValidationError):
        spec.tiers.ram.keep = 3  # type: ignore[misc]
    dumped = spec.model_dump(by_alias=True, exclude_defaults=True)
    assert dumped["tiers"]["pvc"] == {"claimName": "ckpt", "subPath": "runs/a"}  # every: default
    assert parse_spec(dumped) == spec


@pytest.mark.parametrize(
    ("text", "value"),
    [("16Gi", 16 * 2**30), ("1Mi", 2**20), ("1G", 10**9), ("1.5Gi", 3 * 2**29), ("1e3", 1000)],
)
def test_quantities_parse_like_kubernetes(text: str, value: int) -> None:
    assert validation.quantity_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("15m", 900), ("1h30m", 5400), ("1.5s", 1.5)]
)
def test_durations_parse_like_go(text: str, seconds: float) -> None:
    assert validation.parse_duration(text) == seconds


@pytest.mark.parametrize(
    "name", ["my-ckpts", "a_b", "abc", "ckpt.example.com", "a" * 63, ".".join(["a" * 63] * 3)]
)
def test_valid_bucket_names_pass(name: str) -> None:
    assert validation.check_bucket_name(name) == name


def test_secret_ref_credentials_parse() -> None:
    spec = parse_spec(
        PolicyBuilder()
        .gcs("my-ckpts", credentials={"type": "SecretRef", "secretRef": {"name": "gcs-key"}})
        .spec()
    )
    assert spec.tiers.gcs is not None and spec.tiers.gcs.credentials.secret_ref is not None
    assert spec.tiers.gcs.credentials.secret_ref.key == "key.json"


def test_to_sidecar_config_maps_every_tier() -> None:
    spec = parse_spec(
        PolicyBuilder()
        .ram(sizeLimit="2Gi", keep=2, every={"steps": 5})
        .pvc("ckpt", steps=None, every={"steps": 50, "duration": "10m"}, keep=3, subPath="runs")
        .gcs("my-ckpts", steps=None, every={"duration": "1h"}, prefix="llm", keep=4)
        .restore(order=["ram", "gcs", "pvc"], verify=False, allowFreshStart=True)
        .sidecar(terminationGracePeriodSeconds=120, ports={"metrics": 9500})
        .spec()
    )
    cfg = to_sidecar_config(
        spec, "team-a.llm", policy="p", namespace="team-a", report_endpoint="https://op:9443"
    )
    assert isinstance(cfg, StrataConfig)
    assert cfg.job_id == "team-a.llm" and cfg.policy == "p" and cfg.namespace == "team-a"
    assert cfg.ram.size_limit_bytes == 2 * 2**30
    assert cfg.ram.keep == 2 and cfg.ram.every.steps == 5 and cfg.ram.medium == "Memory"
    assert cfg.pvc is not None
    assert (cfg.pvc.claim_name, cfg.pvc.sub_path, cfg.pvc.keep) == ("ckpt", "runs", 3)
    assert (cfg.pvc.every.steps, cfg.pvc.every.seconds) == (50, 600.0)
    assert cfg.gcs is not None
    assert (cfg.gcs.bucket, cfg.gcs.prefix, cfg.gcs.keep) == ("my-ckpts", "llm", 4)
    assert (cfg.gcs.every.steps, cfg.gcs.every.seconds) == (None, 3600.0)
    assert cfg.restore.order == ("ram", "gcs", "pvc")
    assert cfg.restore.verify is False and cfg.restore.allow_fresh_start is True
    assert cfg.termination_grace_seconds == 120.0
    assert cfg.metrics_port == 9500
    assert cfg.report.endpoint == "https://op:9443"
    # the contract survives its own serialisation (what the webhook injects)
    assert StrataConfig.from_env(cfg.to_env()) == cfg


@pytest.mark.parametrize(
    "endpoint",
    ["https://storage-psc1.p.googleapis.com", "http://10.0.0.5:4443", "http://localhost:8080"],
)
def test_a_gcs_endpoint_reaches_the_sidecar_config(endpoint: str) -> None:
    spec = parse_spec(PolicyBuilder().gcs("my-ckpts", endpoint=endpoint).spec())
    cfg = to_sidecar_config(spec, "ns.job")
    assert cfg.gcs is not None and cfg.gcs.endpoint == endpoint
    assert StrataConfig.from_env(cfg.to_env()).gcs == cfg.gcs


def test_no_gcs_endpoint_leaves_the_sidecar_on_the_real_service() -> None:
    cfg = to_sidecar_config(parse_spec(PolicyBuilder().gcs("my-ckpts").spec()), "ns.job")
    assert cfg.gcs is not None and cfg.gcs.endpoint is None


def test_to_sidecar_config_defaults_restore_order_to_configured_tiers() -> None:
    cfg = to_sidecar_config(parse_spec(PolicyBuilder().pvc().spec()), "ns.job")
    assert cfg.gcs is None
    assert cfg.tiers_in_restore_order() == ["ram", "pvc"]
    assert cfg.termination_grace_seconds == 30.0
    assert cfg.ram.every.steps == 10


def test_to_sidecar_config_honours_the_pods_grace_period() -> None:
    spec = parse_spec(PolicyBuilder().sidecar(terminationGracePeriodSeconds=60).spec())
    cfg = to_sidecar_config(spec, "ns.job", termination_grace_seconds=300)
    assert cfg.termination_grace_seconds == 300


def test_status_model_accepts_what_the_operator_and_receiver_write() -> None:
    status = api.CheckpointPolicyStatus.model_validate(
        {
            "observedGeneration": 3,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Reconciled",
                    "message": "ok",
                    "lastTransitionTime": "2026-01-02T03:04:05Z",
                    "observedGeneration": 3,
                }
            ],
            "newestCompleteStep": {"ram": 120, "pvc": 100},
            "jobs": [
                {
                    "jobId": "team-a.llm",
                    "newestCompleteStep": {"ram": 120, "pvc": 100, "gcs": 0},
                    "lastRestore": {
                        "tier": "pvc",
                        "step": 100,
                        "seconds": 2.5,
                        "time": "2026-01-02T03:04:05Z",
                    },
                    "lastError": {"message": "upload failed", "time": "2026-01-02T03:04:05Z"},
                }
            ],
        }
    )
    assert status.jobs[0].last_restore is not None and status.jobs[0].last_restore.step == 100
    assert status.newest_complete_step is not None and status.newest_complete_step.gcs is None
    too_many = [{"jobId": f"j{i}"} for i in range(api.MAX_JOBS + 1)]
    with pytest.raises(ValidationError, match="jobs"):
        api.CheckpointPolicyStatus.model_validate({"jobs": too_many})


def test_every_pod_of_a_workload_shares_one_validated_peer_config() -> None:
    """The peers are validated once per policy and workload, not once per pod (an admission
    burst of a 512-pod job built 512 identical lists); a changed workload or policy is new, and
    an invalid range is refused every time."""
    spec = parse_spec(PolicyBuilder().pvc().set("peers", {"mode": "replicate", "copies": 1}).spec())
    ranges = [{"prefix": "js-w-", "groups": 2, "count": 2, "domain": "js.ns.svc", "port": 8470}]
    one = to_sidecar_config(spec, "ns.job", peer_ranges=ranges)
    two = to_sidecar_config(spec, "ns.job", peer_ranges=[dict(r) for r in ranges])
    assert one.peers is not None and one.peers is two.peers
    assert [p.id for p in one.peers.members] == ["js-w-0-0", "js-w-0-1", "js-w-1-0", "js-w-1-1"]
    moved = [ranges[0] | {"port": 8471}]
    other = to_sidecar_config(spec, "ns.job", peer_ranges=moved)
    assert other.peers is not None and other.peers.members[3].address == "js-w-1-1.js.ns.svc:8471"
    spec2 = parse_spec(
        PolicyBuilder().pvc().set("peers", {"mode": "replicate", "copies": 2}).spec()
    )
    assert to_sidecar_config(spec2, "ns.job", peer_ranges=ranges).peers.copies == 2  # type: ignore[union-attr]
    bad = [ranges[0] | {"prefix": "js w-"}]
    for _ in range(2):
        with pytest.raises(ValidationError):
            to_sidecar_config(spec, "ns.job", peer_ranges=bad)
