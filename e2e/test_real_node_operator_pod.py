"""The operator installed by ``helm install`` of ``charts/strata`` as a real pod on the real node.

Real parts: a control plane of its own (`e2e.node.stack`: its apiserver routes webhook calls to
the Service's endpoints itself, ``--enable-aggregator-routing``, there being no kube-proxy), the
kubelet v1.35.4 with containerd/runc and the CNI bridge, the chart rendered and installed by the
real ``helm``, the operator image built from ``operator/Dockerfile`` running as the chart's pod
(restricted securityContext, its Service, its webhook configuration, the Lease), the sidecar and
trainer images, the kernel's tmpfs for the RAM tier, a hostPath PV for the PVC tier. The operator
pod reaches the apiserver through a TCP relay on the bridge gateway (``KUBERNETES_SERVICE_HOST``
through the chart's ``operator.extraEnv``); the trainer pod resolves the reports Service's name
to the operator pod through ``hostAliases`` (no cluster DNS). No operator process runs outside the
node. Flow:

* the operator pod comes up on the real node, Ready, leading, and its webhook configuration (the
  chart's, service-based) gets the CA the operator generated;
* it reconciles a CheckpointPolicy (Ready); a labelled pod is injected by its webhook through the
  Service: native sidecar, the chart's sidecar image (the policy names none), the RAM emptyDir;
* SIGKILL of the trainer's process: the kubelet restarts it and it restores from RAM the newest
  step saved, with the bytes saved (`e2e.test_real_node.sigkill_trainer_and_restore`);
* the sidecar's reports, sent over the pod network to the operator pod, are folded into the
  policy's ``status.jobs[]`` by it: the restore (that step, from RAM) and newest steps that the
  trainer saved.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import REAL_NODE_NAME, Binaries
from e2e.demo_cluster import EXPECTED_TIERS, run_story, table
from e2e.node.fixtures import strata_images, unavailable  # noqa: F401 - fixture
from e2e.node.harness import NodeUnavailable, missing_prerequisites
from e2e.node.images import BuiltImage
from e2e.node.stack import (
    NAMESPACE,
    OPERATOR_IMAGE,
    REPORTS_HOST,
    SIDECAR_IMAGE,
    WEBHOOK_CONFIG,
    OperatorPodStack,
)
from e2e.node.story import (
    checkpoint_policy,
    container_status,
    pod_events,
    policy_job,
    saved_events,
    setup_pvc,
    sigkill_trainer_and_restore,
    trainer_pod,
    wait_for,
    wait_restore_folded,
    wait_running,
)
from strata_operator.constants import INJECTED_ANNOTATION, POLICY_LABEL, SIDECAR_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(1500)]

POLICY = "fast"


@pytest.fixture(scope="module")
def stack(
    k8s_binaries: Binaries,
    strata_images: dict[str, BuiltImage],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[OperatorPodStack]:
    missing = missing_prerequisites(k8s_binaries.bin_dir)
    if missing:
        unavailable("real node prerequisites missing: " + "; ".join(missing))
    if not (k8s_binaries.bin_dir / "helm").is_file():
        unavailable(f"helm is missing from {k8s_binaries.bin_dir} (make tools)")
    st = OperatorPodStack(tmp_path_factory.mktemp("operator-pod"), strata_images, k8s_binaries)
    try:
        st.start()
    except NodeUnavailable as exc:
        unavailable(str(exc))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        took = ", ".join(f"{k} {v:.1f} s" for k, v in st.timings.items())
        reporter.write_line(f"[operator pod] stack up: {took}")
    try:
        yield st
    finally:
        st.stop()
        left = st.leftovers()
        assert not left, f"the real node left behind: {left}"


def job_status(st: OperatorPodStack, ns: str, job_id: str) -> dict[str, Any]:
    return policy_job(st, ns, POLICY, job_id)


def test_chart_installed_operator_pod_injects_and_folds_a_ram_restore(
    stack: OperatorPodStack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    st, cluster, node = stack, stack.cluster, stack.node
    # --- the operator: the chart's pod, on the real node, leading, its webhook armed
    op = st.operator_pod
    assert op["spec"]["nodeName"] == REAL_NODE_NAME
    (container,) = op["spec"]["containers"]
    assert container["image"] == OPERATOR_IMAGE
    assert op["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    hooks = st.kubectl_json("get", "mutatingwebhookconfiguration", WEBHOOK_CONFIG)["webhooks"]
    # Service-based as in a cluster: the apiserver resolves it to the pod's endpoint.
    assert all(h["clientConfig"]["service"]["namespace"] == NAMESPACE for h in hooks), hooks
    assert all("url" not in h["clientConfig"] for h in hooks), hooks

    ns = f"op-pod-{uuid.uuid4().hex[:6]}"
    st.create_namespace(ns)
    setup_pvc(cluster, ns, tmp_path / "pvc")
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(checkpoint_policy(POLICY)))

    def policy_ready() -> bool:
        obj = st.kubectl_json("-n", ns, "get", "checkpointpolicy", POLICY)
        conds = (obj.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    wait_for("the policy reconciled Ready by the operator pod", policy_ready, timeout=120)

    # --- a labelled pod, injected by the operator pod's webhook
    run_id = f"{ns}.ram-{uuid.uuid4().hex[:4]}"
    name = "trainer"
    pod_spec = trainer_pod(name, run_id, 400)
    assert pod_spec["metadata"]["labels"][POLICY_LABEL] == POLICY
    pod_spec["spec"]["hostAliases"] = st.host_aliases()
    begin = time.monotonic()
    cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(pod_spec))
    pod = wait_running(cluster, ns, name)
    running_s = time.monotonic() - begin
    assert pod["metadata"]["annotations"][INJECTED_ANNOTATION] == POLICY
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == SIDECAR_IMAGE  # the chart's sidecar.image
    assert any((v.get("emptyDir") or {}).get("medium") == "Memory" for v in pod["spec"]["volumes"])
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    strata_config = next(e for e in trainer["env"] if e["name"] == "STRATA_CONFIG")
    endpoint = json.loads(strata_config["value"])["report"]["endpoint"] or ""
    # The chart's report URL: the reports Service by name (resolved through hostAliases).
    assert endpoint.startswith(f"https://{REPORTS_HOST}:"), strata_config

    wait_for("three RAM saves", lambda: len(saved_events(cluster, ns, name)) >= 3, timeout=240)
    first = pod_events(cluster, ns, name)
    assert first[0]["event"] == "restored" and first[0]["step"] is None, first[0]

    # --- SIGKILL of the trainer: restored from RAM, the step and bytes saved
    killed = sigkill_trainer_and_restore(cluster, ns, node, name, pod)
    step = killed.restored["step"]

    # --- the sidecar's reports, folded into the policy status by the operator pod
    try:
        job = wait_restore_folded(st, ns, POLICY, run_id, step)
    except AssertionError:
        raise AssertionError(
            f"no restore of {run_id} at step {step} in the status: {job_status(st, ns, run_id)}"
            f"\nsidecar log:\n"
            f"{cluster.kubectl('-n', ns, 'logs', name, '-c', SIDECAR_NAME, '--tail=30', check=False)}"
            f"\noperator log:\n{st.operator_log()}"
        ) from None
    assert job["lastRestore"]["tier"] == "ram", job
    saved = set(killed.saved) | {e["step"] for e in saved_events(cluster, ns, name)}
    assert job["newestCompleteStep"]["ram"] in saved, (job, sorted(saved))
    # The operator pod did all of it without a restart.
    op_now = st.kubectl_json("-n", NAMESPACE, "get", "pod", op["metadata"]["name"])
    assert container_status(op_now, "operator").get("restartCount") == 0, st.operator_log(True)
    assert (
        st.relay is not None and st.relay.connections > 0
    )  # its API traffic went through the relay on the bridge

    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = (
        f"[operator pod] injected pod Running {running_s:.1f} s after create; kubelet restart "
        f"after SIGKILL {killed.restart_s:.1f} s; restored step {step} from "
        f"{killed.restored['tier']} in {killed.restored['seconds']} s, {killed.restore_s:.1f} s "
        f"after the kill; folded into the policy status by the operator pod"
    )
    if reporter is not None:
        reporter.write_line(line)
    print(line)
    # Its trainer would keep a core busy during the next test.
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_make_demo_cluster_story(
    stack: OperatorPodStack, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """`make demo-cluster`'s story (`e2e.demo_cluster.run_story`) on this module's stack: the
    SIGKILLed trainer restores from RAM, the deleted pod's replacement from the PVC, and once
    that pod is deleted and the PVC wiped, the next one from the bucket behind the policy's
    ``tiers.gcs.endpoint``; each with the bytes saved, each restore folded into the policy
    status by the operator pod."""
    ns = f"demo-{uuid.uuid4().hex[:6]}"
    recoveries = run_story(stack, ns, tmp_path / "pvc", log=lambda _msg: None)
    assert [r.tier for r in recoveries] == EXPECTED_TIERS, recoveries
    for r in recoveries:
        assert r.bytes_match, r
        assert r.status["lastRestore"]["tier"] == r.tier, r
        assert r.status["lastRestore"]["step"] == r.step, r
    text = table(recoveries)
    assert "DIFFER" not in text
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("[operator pod] demo-cluster story:\n" + text)
    print(text)
