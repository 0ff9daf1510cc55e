"""A failed e2e test leaves the namespace's objects, Events and container logs behind
(``e2e.fixtures.save_evidence``), on the real apiserver."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.fixtures import EVIDENCE_ENV, save_evidence

pytestmark = pytest.mark.e2e


def test_evidence_holds_the_namespaces_objects_and_events(
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    k8s_fake_node: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(EVIDENCE_ENV, str(tmp_path))
    k8s_cluster.request(
        f"/api/v1/namespaces/{k8s_namespace}/configmaps",
        "POST",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "clue"}, "data": {"k": "v"}},
    )
    k8s_cluster.request(
        f"/api/v1/namespaces/{k8s_namespace}/pods",
        "POST",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "suspect"},
            "spec": {
                "nodeName": k8s_fake_node,
                "containers": [{"name": "c", "image": "busybox"}],
            },
        },
    )
    where = save_evidence(k8s_cluster, k8s_namespace)
    assert where == tmp_path / k8s_namespace
    objects = (where / "objects.yaml").read_text()
    assert "name: clue" in objects and "name: suspect" in objects
    assert (where / "pods.txt").read_text().split() == ["pod/suspect"]
    # A kwok pod has no logs: the file says why instead of the test raising.
    assert (where / "suspect.log").exists()
    assert (where / "events.txt").exists()
