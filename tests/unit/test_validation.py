"""Value rules of the CheckpointPolicy API parsed like Kubernetes parses them (issue 15, item 1)."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from strata_operator.admission.mutation import InjectionSettings, build_pod_patch
from strata_operator.api import CheckpointPolicySpec, ResourcesSpec
from strata_operator.api import validation as v
from strata_operator.reconcile.policy import InvalidSpec, parse_spec
from tests.fixtures.pods import PodBuilder
from tests.fixtures.policies import PolicyBuilder

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2E", 2 * 10**18),
        ("1Ei", 2**60),
        ("8Ei", 8 * 2**60),
        ("1P", 10**15),
        ("1Pi", 2**50),
        ("1E3", 1000),
        ("1e3", 1000),
        ("1e-3", Decimal("0.001")),
        ("+1k", 1000),
        ("-1Gi", -(2**30)),
        (".5Mi", 2**19),
        ("1e400", Decimal("1e400")),
        ("100m", Decimal("0.1")),
    ],
)
def test_quantities_parse_with_every_suffix_like_apimachinery(text: str, value: object) -> None:
    assert v.parse_quantity(text) == Decimal(str(value))


@pytest.mark.parametrize("text", ["1e1.5", "1e99999999999", "1x", "", "Gi", "1 Gi", "1.2.3"])
def test_malformed_or_absurd_quantities_are_a_value_error(text: str) -> None:
    # Before: "2E" and friends raised decimal.InvalidOperation, which escaped validation and
    # crash-looped the reconcile (and made the webhook answer 500).
    with pytest.raises(ValueError):
        v.parse_quantity(text)


@pytest.mark.parametrize("size", ["1Ei", "2E", "1e400", "1Pi", "64Ti", "8Ei"])
def test_huge_size_limits_are_refused_not_crashed_on(size: str) -> None:
    with pytest.raises(InvalidSpec, match="at most 32Ti"):
        parse_spec(PolicyBuilder().ram(sizeLimit=size).spec())


def test_the_largest_size_limit_keeps_the_startup_probe_in_int32() -> None:
    spec = PolicyBuilder().ram(sizeLimit=v.MAX_SIZE_LIMIT).spec()
    ops = build_pod_patch(
        PodBuilder("p").policy("p").container("t").obj(), spec, InjectionSettings(), policy_name="p"
    )
    sidecar = next(op["value"][0] for op in ops if op["path"] == "/spec/initContainers")
    threshold = sidecar["startupProbe"]["failureThreshold"]
    assert 0 < threshold < 2**31 - 1
    memory = v.parse_quantity(sidecar["resources"]["limits"]["memory"])
    assert memory < 2**63 - 1


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2562047h", 2562047 * 3600.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("1500ms", 1.5),
        ("1μs", 1e-6),
    ],
)
def test_durations_parse_like_go(text: str, seconds: float) -> None:
    assert math.isclose(v.parse_duration(text), seconds)


@pytest.mark.parametrize("text", ["2562048h", "99999999999999999999h", "9223372037s"])
def test_overflowing_durations_say_out_of_range_not_at_least_1s(text: str) -> None:
    with pytest.raises(ValueError, match="out of range") as err:
        v.parse_duration(text)
    assert "at least" not in str(err.value)
    with pytest.raises(InvalidSpec, match="out of range"):
        parse_spec(PolicyBuilder().pvc(steps=None, every={"duration": text}).spec())


@pytest.mark.parametrize(
    ("resources", "fragment"),
    [
        ({"requests": {"cpu": "-1"}}, "negative"),
        ({"requests": {"memory": "-1Gi"}}, "negative"),
        ({"requests": {"ephemeral-storage": "-5"}}, "negative"),
        ({"requests": {"memory": "1"}}, "between 64Mi and 1Ti"),
        ({"limits": {"memory": "8Ei"}}, "between 64Mi and 1Ti"),
        ({"requests": {"cpu": "1e400"}}, "at most 4096"),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}, "must not exceed its limit"),
        ({"requests": {"nvidia.com/gpu": 1}}, "overcommitted"),
        ({"requests": {"hugepages-2Mi": "2Mi"}}, "overcommitted"),
        ({"limits": {"nvidia.com/gpu": "1.5"}}, "whole numbers"),
        ({"limits": {"gpu": 1}}, "resource names"),
        ({"limits": {"kubernetes.io/x": 1}}, "resource names"),
        ({"limits": {"node.k8s.io/x": 1}}, "resource names"),
        ({"limits": {"a b/c": 1}}, "resource names"),
    ],
)
def test_resources_follow_corev1(resources: dict[str, dict[str, object]], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ResourcesSpec.model_validate(resources)


def test_valid_resources_pass() -> None:
    ResourcesSpec.model_validate(
        {
            "requests": {"cpu": "500m", "memory": "512Mi", "nvidia.com/gpu": 1},
            "limits": {"cpu": 2, "memory": "1Gi", "nvidia.com/gpu": "1", "hugepages-2Mi": "4Mi"},
        }
    )


def test_a_cpu_limit_below_the_default_request_lowers_the_injected_request() -> None:
    # Before: limits.cpu 100m with the injected 250m request made every pod invalid.
    spec = PolicyBuilder().sidecar(resources={"limits": {"cpu": "100m"}}).spec()
    ops = build_pod_patch(
        PodBuilder("p").policy("p").container("t").obj(), spec, InjectionSettings(), policy_name="p"
    )
    sidecar = next(op["value"][0] for op in ops if op["path"] == "/spec/initContainers")
    assert sidecar["resources"]["requests"]["cpu"] == "100m"
    assert sidecar["resources"]["limits"]["cpu"] == "100m"


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/etc",
        "/etc/strata",
        "/proc",
        "/sys/fs/cgroup",
        "/dev",
        "/dev/sda",
        "/var/lib/kubelet",
        "/var/lib/kubelet/pods",
        "/var/run/containerd",
        "/dev/shm/../../etc",
        "/dev/shm/./x",
        "/dev/shm/a\x00b",
        "/dev/shm/a\rb",
        "/dev/shm/a\nb",
        "/dev/shm/",
        "//dev/shm",
        "dev/shm",
    ],
)
def test_dangerous_or_malformed_host_paths_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match="hostPath must be"):
        v.check_host_path(path)


@pytest.mark.parametrize("path", ["/dev/shm/strata", "/dev/shm", "/mnt/tmpfs/ckpt", "/data/strata"])
def test_usable_host_paths_pass(path: str) -> None:
    assert v.check_host_path(path) == path


@pytest.mark.parametrize(
    "prefix",
    ["a/./b", ".", "..", "a/..", "bad\x01", "tab\there", "a\nb", "é" * 129, "a//b", "/a", "a/"],
)
def test_unusable_gcs_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix must be"):
        v.check_prefix(prefix)


def test_prefix_plus_the_longest_object_name_fits_gcs() -> None:
    longest_job = "j" * 512
    name = f"{'p' * v.MAX_PREFIX_BYTES}/{longest_job}/steps/{10**12 - 1:012d}/rank-99999.manifest"
    assert len(name.encode()) <= 1024
    assert v.check_prefix("teams/llm/é") == "teams/llm/é"


@pytest.mark.parametrize(
    "image",
    ["UPPER/x", "x:bad:tag", "x@sha256:abc", "-x", "x y", "ghcr.io//x", "x:" + "t" * 129, "a/B"],
)
def test_invalid_image_references_are_refused(image: str) -> None:
    with pytest.raises(ValueError, match="image reference"):
        v.check_image(image)


def test_a_policy_name_longer_than_a_label_value_is_invalid() -> None:
    spec = PolicyBuilder().spec()
    assert isinstance(parse_spec(spec, name="p" * 63), CheckpointPolicySpec)
    with pytest.raises(InvalidSpec, match="at most 63 characters"):
        parse_spec(spec, name="p" * 64)


@pytest.mark.parametrize("text", ["Infinity", "NaN", "1_000", "1K", "1ki", "1mi", " 1e3x", "0x10"])
def test_spellings_decimal_or_the_client_take_but_the_apiserver_refuses_are_refused(
    text: str,
) -> None:
    # kubernetes.utils.parse_quantity computes with Decimal(), which takes these; the apiserver's
    # pattern does not, and the CRD must accept exactly what the apiserver accepts.
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        v.parse_quantity(text)


def test_a_fractional_exponent_says_whole_number() -> None:
    with pytest.raises(ValueError, match="whole number"):
        v.parse_quantity("1e1.5")


@pytest.mark.parametrize(
    ("value", "suffix", "text"),
    [
        (Decimal("1.350"), "m", "1350m"),
        (Decimal("1.3501"), "m", "1351m"),  # rounded up: a pod-level request >= the sum
        (Decimal("2.000"), "", "2"),
        (Decimal("1E+3"), "", "1000"),
        (16 * 2**30, "Gi", "16Gi"),
        (2**63, "Ki", "9007199254740992Ki"),
    ],
)
def test_format_quantity_writes_whole_units_rounded_up(
    value: Decimal | int, suffix: str, text: str
) -> None:
    assert v.format_quantity(value, suffix) == text
    assert v.parse_quantity(text) >= Decimal(value)


def test_format_quantity_refuses_an_unknown_suffix_with_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot be written"):
        v.format_quantity(Decimal(1), "Xi")


def test_the_api_imports_only_the_clients_pure_quantity_module() -> None:
    # pyproject's import contract exempts validation -> kubernetes as a whole (import-linter sees
    # an external package only as one module); the edge must stay the pure quantity code.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(v))
    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert {m for m in imported if m and m.split(".")[0] == "kubernetes"} == {
        "kubernetes.utils.quantity"
    }


@pytest.mark.parametrize("text", ["1d", "1w", "1y", "-1s", "+1s", "0", "1h 30m"])
def test_durations_only_in_gos_syntax(text: str) -> None:
    # durationpy also takes days, weeks, years and a sign; Go's ParseDuration (CEL) does not.
    with pytest.raises(ValueError, match="not a duration"):
        v.parse_duration(text)


def test_the_longest_go_duration_parses_and_one_second_more_is_out_of_range() -> None:
    assert math.isclose(v.parse_duration("2562047h47m16s"), 9223372036.0)
    with pytest.raises(ValueError, match="out of range"):
        v.parse_duration("2562047h47m17s")


@settings(max_examples=300, deadline=None)
@given(st.from_regex(v.QUANTITY_PATTERN, fullmatch=True) | st.text(max_size=12))
def test_any_text_parses_to_a_decimal_or_raises_only_value_error(text: str) -> None:
    # The library underneath raises decimal errors of its own; the API's contract is ValueError.
    try:
        value = v.parse_quantity(text)
    except ValueError:
        return
    assert isinstance(value, Decimal) and value.is_finite()


@settings(max_examples=300, deadline=None)
@given(st.decimals(min_value=0, max_value=2**63, allow_nan=False, places=6))
def test_formatted_millis_parse_back_within_one_milli_above(value: Decimal) -> None:
    text = v.format_quantity(value, "m")
    assert value <= v.parse_quantity(text) < value + Decimal("0.001")
