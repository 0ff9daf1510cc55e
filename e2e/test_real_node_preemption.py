"""Preemption on a real node: pod deletion with a 30 s grace period and a 256 MiB state.

The real kubelet and containerd of ``e2e/test_real_node.py``; the trainer is
``tests/fixtures/preempted.py`` (mounted read-only from the host, torch from the host's
site-packages) as the container's PID 1, beside the injected native sidecar. The policy's PVC
interval is never due, so only the termination flush can put a step on the PVC. For each way a
trainer treats SIGTERM -- its loop polls ``ckpt.should_stop`` (a final save of the current step),
its own SIGTERM handler installed before the Checkpointer (chained), or it ignores the handler API
(the newest committed RAM step is flushed) -- the pod is deleted and a replacement pod of the same
run id, with an empty RAM tier, must restore that step from the PVC with its bytes.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import REPO_ROOT, LocalCluster
from e2e.node.fixtures import real_node, strata_images  # noqa: F401 - fixtures
from e2e.node.harness import RealNode
from e2e.node.story import (
    SIDECAR_IMAGE,
    kubectl_json,
    setup_pvc,
    trainer_pod_spec,
    wait_for,
    wait_running,
)
from e2e.operator_fixtures import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(1800)]

MIB = 256
GRACE = 30
SAVE_EVERY = 5  # tests/fixtures/preempted.py


def apply_policy(cluster: LocalCluster, ns: str) -> None:
    policy = {
        "apiVersion": "strata.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": {"name": "preempt", "namespace": ns},
        "spec": {
            "tiers": {
                # Two slots of the 256 MiB state and the commit records.
                "ram": {"medium": "Memory", "sizeLimit": "768Mi", "keep": 1, "every": {"steps": 1}},
                # Never due: only the termination flush puts a step on the PVC.
                "pvc": {"claimName": "ckpt", "every": {"steps": 1000000}, "keep": 2},
            },
            "restore": {"allowFreshStart": True},
            "sidecar": {"image": SIDECAR_IMAGE, "terminationGracePeriodSeconds": GRACE},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))


def trainer_pod(name: str, run_id: str, mode: str) -> dict[str, Any]:
    return trainer_pod_spec(
        name,
        run_id,
        "preempt",
        [mode, "/dev/stdout", str(MIB)],
        command=["python", "/host-fixtures/preempted.py"],
        restart_policy="Never",
        grace_seconds=GRACE,
        host_mounts={"fixtures": REPO_ROOT / "tests" / "fixtures"},
    )


def lines(cluster: LocalCluster, ns: str, pod: str) -> list[str]:
    text = cluster.kubectl("-n", ns, "logs", pod, "-c", "trainer", check=False)
    return [line.strip() for line in text.splitlines()]


def saved(log: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in log if line.startswith("saved ")]


@pytest.fixture
def flow(
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    real_node: RealNode,  # noqa: F811
    operator_running: OperatorProcess,
    tmp_path: Path,
) -> tuple[LocalCluster, str, Path]:
    pvc = tmp_path / "pvc"
    setup_pvc(k8s_cluster, k8s_namespace, pvc)
    apply_policy(k8s_cluster, k8s_namespace)
    return k8s_cluster, k8s_namespace, pvc


@pytest.mark.parametrize("mode", ["poll", "user-handler", "ignore"])
def test_pod_deletion_flushes_the_newest_ram_step_and_the_replacement_restores_it(
    flow: tuple[LocalCluster, str, Path], mode: str, request: pytest.FixtureRequest
) -> None:
    cluster, ns, _pvc = flow
    run_id = f"{ns}.{mode}-{uuid.uuid4().hex[:4]}"
    first = f"first-{mode}"
    cluster.kubectl(
        "-n", ns, "create", "-f", "-", input=json.dumps(trainer_pod(first, run_id, mode))
    )
    wait_running(cluster, ns, first)
    wait_for("two RAM saves", lambda: len(saved(lines(cluster, ns, first))) >= 2, timeout=300)
    begin = time.monotonic()
    cluster.kubectl("-n", ns, "delete", "pod", first, "--wait=false")
    log: list[str] = []
    exit_code: int | None = None

    def gone() -> bool:
        nonlocal log, exit_code
        current = lines(cluster, ns, first)
        if len(current) >= len(log):
            log = current
        pod = cluster.kubectl("-n", ns, "get", "pod", first, "-o", "json", "--ignore-not-found")
        if not pod.strip():
            return True
        for st in (json.loads(pod).get("status") or {}).get("containerStatuses") or []:
            term = (st.get("state") or {}).get("terminated")
            if st["name"] == "trainer" and term:
                exit_code = term.get("exitCode")
        return False

    wait_for("the pod to be deleted", gone, timeout=GRACE + 60)
    deleted_s = time.monotonic() - begin
    final = [line.split() for line in log if line.startswith("final ")]
    if mode == "ignore":
        assert not final, log
        expected_min = max(saved(log))
    else:
        assert len(final) == 1, log
        assert (final[0][2], final[0][3]) == (final[0][1], "True"), log  # durable within budget
        expected_min = int(final[0][1])
        assert expected_min >= max(saved(log))  # a final save only when newer than the last
    if mode == "user-handler":
        assert "user-handler" in log
    if exit_code is not None:
        assert exit_code == 143, (exit_code, log)

    second = f"second-{mode}"
    cluster.kubectl(
        "-n", ns, "create", "-f", "-", input=json.dumps(trainer_pod(second, run_id, "restore"))
    )
    restored = wait_for(
        "the replacement's restore",
        lambda: next(
            (x.split() for x in lines(cluster, ns, second) if x.startswith("restored ")), None
        ),
        timeout=300,
    )
    # restored <step> <tier> <bytes as saved>
    assert restored[2:] == ["pvc", "True"], restored
    step = int(restored[1])
    if mode == "ignore":
        # A save may commit between its `saved` line and the signal: at least the last logged.
        assert step >= expected_min and step % SAVE_EVERY == 0, (restored, saved(log))
    else:
        assert step == expected_min, (restored, log)
    pod = kubectl_json(cluster, "-n", ns, "get", "pod", second)
    assert (pod.get("status") or {}).get("phase") in ("Running", "Succeeded")
    cluster.kubectl("-n", ns, "delete", "pod", second, "--wait=false", check=False)
    line = (
        f"{mode}: pod with {MIB} MiB deleted in {deleted_s:.1f} s (grace {GRACE} s, trainer exit "
        f"{exit_code}); replacement restored step {step} from the PVC"
    )
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[real node] {line}")
    print(line)
