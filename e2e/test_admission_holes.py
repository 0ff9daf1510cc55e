"""Pods the apiserver used to refuse after Strata's injection, without a word of Strata
(issue 27): a pod-level CPU limit below what the sidecar requests is now raised so that the
apiserver accepts the injected pod."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client
from tests.fixtures.pods import PodBuilder

from e2e.cluster import LocalCluster
from e2e.operator_fixtures import OperatorProcess
from e2e.test_webhook import create_pod, create_policy, sidecar_of
from strata_operator.api.validation import parse_quantity

pytestmark = pytest.mark.e2e


@pytest.fixture
def api(k8s_cluster: LocalCluster) -> Iterator[client.ApiClient]:
    api_client = k8s_cluster.api_client()
    try:
        yield api_client
    finally:
        api_client.close()


def test_a_pod_level_cpu_limit_below_the_sidecars_request_is_raised(
    operator_running: OperatorProcess, api: client.ApiClient, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    create_policy(api, ns, pvc=None, ram_size="256Mi")
    obj = (
        PodBuilder("cpu-limited", ns)
        .policy("fast")
        .container("train")
        .spec_field("resources", {"limits": {"cpu": "100m", "memory": "2Gi"}})
        .obj()
    )
    created = create_pod(api, ns, obj)  # before: 422 from the apiserver, no word of Strata
    assert sidecar_of(created) is not None
    pod_level = created["spec"]["resources"]
    assert parse_quantity(pod_level["limits"]["cpu"]) >= parse_quantity(
        pod_level["requests"]["cpu"]
    )
    assert parse_quantity(pod_level["limits"]["cpu"]) == parse_quantity("350m")
