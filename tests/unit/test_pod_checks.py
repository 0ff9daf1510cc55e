"""Pods that cannot be injected are refused with what to change (issue 15, item 2)."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from strata_operator import constants as k
from strata_operator.admission.mutation import InjectionError, InjectionSettings, build_pod_patch
from strata_operator.admission.pod_checks import fully_injected, is_injected
from strata_operator.api.validation import parse_quantity
from tests.fixtures.pods import PodBuilder, policy_obj

pytestmark = pytest.mark.unit

SETTINGS = InjectionSettings(report_endpoint="https://op:8444", report_ca_pem="-----CA-----\n")


def pod() -> PodBuilder:
    return PodBuilder("p").policy("fast").container("train")


def refused(obj: dict[str, Any]) -> str:
    with pytest.raises(InjectionError) as err:
        build_pod_patch(obj, policy_obj(), SETTINGS)
    return str(err.value)


@pytest.mark.parametrize(
    ("obj", "fragments"),
    [
        (pod().init_container(k.SIDECAR_NAME).obj(), ["init container", "rename it"]),
        (pod().volume(k.RAM_VOLUME, hostPath={"path": "/tmp"}).obj(), ["volume 'strata-ram'"]),
        (pod().volume(k.TOKEN_VOLUME, emptyDir={}).obj(), ["volume 'strata-token'"]),
        (
            PodBuilder("p")
            .policy("fast")
            .container("train", env=[{"name": "STRATA_CONFIG", "value": "{}"}])
            .obj(),
            ["sets env STRATA_CONFIG"],
        ),
        (
            PodBuilder("p")
            .policy("fast")
            .container("train", env=[{"name": "POD_UID", "value": "x"}])
            .obj(),
            ["env POD_UID", "metadata.uid"],
        ),
        (
            PodBuilder("p")
            .policy("fast")
            .container("train", ports=[{"containerPort": 9464, "protocol": "TCP"}])
            .obj(),
            ["port 9464", "spec.sidecar.ports.metrics"],
        ),
        (
            PodBuilder("p")
            .policy("fast")
            .container("train", ports=[{"name": "strata-metrics", "containerPort": 80}])
            .obj(),
            ["strata-metrics"],
        ),
        (
            pod().annotation(k.INJECTED_ANNOTATION, "fast").obj(),
            ["written only by the Strata webhook"],
        ),
        (pod().annotation(k.REPORT_CA_ANNOTATION, "x").obj(), ["strata.dev/report-ca"]),
        (pod().spec_field("os", {"name": "windows"}).obj(), ["windows", "Linux"]),
        (
            pod().annotation("big", "x" * (k.MAX_ANNOTATIONS_BYTES - 30)).obj(),
            ["256", "annotations"],
        ),
    ],
)
def test_collisions_and_unsupported_pods_are_refused_with_what_to_change(
    obj: dict[str, Any], fragments: list[str]
) -> None:
    message = refused(obj)
    assert message.startswith("pod team-a/p cannot be injected: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_every_problem_is_listed_at_once() -> None:
    obj = pod().init_container(k.SIDECAR_NAME).volume(k.PVC_VOLUME, emptyDir={}).obj()
    message = refused(obj)
    assert "rename it" in message and "strata-pvc" in message


def test_an_injected_pod_is_recognised_and_reinvocation_has_nothing_to_do() -> None:
    original = pod().init_container("fetch").obj()
    assert not is_injected(original)
    injected = jsonpatch.apply_patch(original, build_pod_patch(original, policy_obj(), SETTINGS))
    assert is_injected(injected) and fully_injected(injected)
    # the ServiceAccount plugin mounts a token into our sidecar: still nothing to add
    again = copy.deepcopy(injected)
    again["spec"]["initContainers"][-1]["volumeMounts"].append(
        {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    )
    assert fully_injected(again)
    assert build_pod_patch(again, policy_obj(), SETTINGS) == []
    # a container added by a later webhook is not fully injected: it gets the env
    again["spec"]["containers"].append({"name": "late", "image": "busybox"})
    assert is_injected(again) and not fully_injected(again)
    ops = build_pod_patch(again, policy_obj(), SETTINGS)
    assert ops and all(op["path"].startswith("/spec/containers/1/") for op in ops)


def test_a_user_container_named_like_the_sidecar_is_not_an_injection() -> None:
    forged = pod().annotation(k.INJECTED_ANNOTATION, "fast").init_container(k.SIDECAR_NAME).obj()
    assert not is_injected(forged)
    assert "rename it" in refused(forged)


def test_pod_level_resources_are_raised_by_the_sidecars_share() -> None:
    obj = (
        pod()
        .spec_field(
            "resources", {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
        )
        .obj()
    )
    patched = jsonpatch.apply_patch(obj, build_pod_patch(obj, policy_obj(ram_size="1Gi"), SETTINGS))
    sidecar = patched["spec"]["initContainers"][-1]["resources"]
    side_mem = int(parse_quantity(sidecar["requests"]["memory"]))
    assert patched["spec"]["resources"]["requests"]["cpu"] == "2250m"
    assert (
        parse_quantity(patched["spec"]["resources"]["requests"]["memory"]) == 4 * 2**30 + side_mem
    )
    assert parse_quantity(patched["spec"]["resources"]["limits"]["memory"]) == 8 * 2**30 + side_mem
