"""Real pods on the real node, part two: what the injected sidecar and its reports look like from
the outside, the HostPath RAM medium, a state larger than the RAM tier, and two gloo ranks.

Real parts: the control plane, the kubelet v1.35.4 with containerd/runc and the CNI bridge
(`e2e.node.harness`), Strata's sidecar and trainer images built from their Dockerfiles, the
operator as a local process whose report receiver listens on the bridge gateway
(`e2e.node.operator`: the pods reach it over the pod network and authenticate with their projected
tokens, checked by a real TokenReview), the kernel's tmpfs for the RAM tier, torch.distributed
gloo between two pods over the bridge. Flows:

* the injected sidecar runs with a read-only root filesystem (writing under ``/`` fails with
  EROFS inside the running container, ``/tmp`` is its writable emptyDir), never restarts, and its
  reports reach the operator: the policy's ``status.jobs[]`` shows the pod's job, its newest RAM
  and PVC steps and its fresh start; time-to-ready of the injected pod is printed;
* ``ram.medium: HostPath`` on a node tmpfs: the replacement of a deleted pod restores the newest
  step from the node's RAM, with the bytes saved;
* a state larger than the RAM tier's ``sizeLimit`` (a real ``tmpfs size=``): every save fails with
  Strata's message naming the size limit and what to change, the trainer keeps training, the pod
  is neither evicted nor restarted, and the policy's ``status.jobs[].lastError`` and a
  ``TierFailed`` Event on the policy carry the message;
* two pods of one job, one gloo rank each, train together over the bridge; the trainer of one is
  SIGKILLed, both trainers are restarted (the survivor's collective fails) and both restore the
  same step from their pod's RAM with the bytes saved.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.node.fixtures import real_node, strata_images  # noqa: F401 - fixtures
from e2e.node.harness import RealNode
from e2e.node.operator import NodeOperator, node_operator  # noqa: F401 - fixture
from e2e.node.story import (
    PVC_EVERY,
    RAM_EVERY,
    SIDECAR_IMAGE,
    container_status,
    delete_pod_keeping_saves,
    kubectl_json,
    pod_events,
    saved_events,
    setup_pvc,
    trainer_pod,
    wait_for,
    wait_restored_event,
    wait_running,
)
from strata_operator.constants import (
    EVENT_TIER_FAILED,
    POLICY_LABEL,
    SIDECAR_NAME,
    TMP_VOLUME,
)

pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(1500)]


def apply_policy(
    cluster: LocalCluster,
    ns: str,
    name: str,
    *,
    medium: str = "Memory",
    size_limit: str = "64Mi",
    host_path: str | None = None,
) -> None:
    ram: dict[str, Any] = {
        "medium": medium,
        "sizeLimit": size_limit,
        "keep": 2,
        "every": {"steps": RAM_EVERY},
    }
    if host_path is not None:
        ram["hostPath"] = host_path
    policy = {
        "apiVersion": "strata.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "tiers": {
                "ram": ram,
                "pvc": {"claimName": "ckpt", "every": {"steps": PVC_EVERY}, "keep": 3},
            },
            "restore": {"allowFreshStart": True},
            "sidecar": {"image": SIDECAR_IMAGE, "terminationGracePeriodSeconds": 30},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))


def make_pod(
    name: str,
    run_id: str,
    policy: str,
    *,
    steps: int = 400,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    pod = trainer_pod(name, run_id, steps)
    pod["metadata"]["labels"][POLICY_LABEL] = policy
    trainer = pod["spec"]["containers"][0]
    trainer["args"] += list(args)
    trainer["env"] += [{"name": k, "value": v} for k, v in (env or {}).items()]
    return pod


def create(cluster: LocalCluster, ns: str, pod: dict[str, Any]) -> None:
    cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(pod))


def policy_status(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    obj = kubectl_json(cluster, "-n", ns, "get", "checkpointpolicy", name)
    return dict(obj.get("status") or {})


def job_status(cluster: LocalCluster, ns: str, policy: str, job_id: str) -> dict[str, Any] | None:
    for job in policy_status(cluster, ns, policy).get("jobs") or []:
        if job.get("jobId") == job_id:
            return dict(job)
    return None


def policy_events(cluster: LocalCluster, ns: str, policy: str) -> list[dict[str, Any]]:
    items = kubectl_json(
        cluster,
        "-n",
        ns,
        "get",
        "events",
        "--field-selector",
        f"involvedObject.kind=CheckpointPolicy,involvedObject.name={policy}",
    )["items"]
    return list(items)


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def report(request: pytest.FixtureRequest, line: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[real node] {line}")
    print(line)


@pytest.fixture
def node_ns(
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    real_node: RealNode,  # noqa: F811
    node_operator: NodeOperator,  # noqa: F811
    tmp_path: Path,
) -> tuple[LocalCluster, str, RealNode]:
    setup_pvc(k8s_cluster, k8s_namespace, tmp_path / "pvc")
    return k8s_cluster, k8s_namespace, real_node


# ----------------------------------------------------------------------------- the sidecar

PROBE_FS = """
import errno, json, os
out = {"uid": os.getuid()}
try:
    open("/strata-probe", "w")
    out["root"] = "writable"
except OSError as exc:
    out["root"] = errno.errorcode.get(exc.errno, str(exc.errno))
with open("/tmp/strata-probe", "w") as f:
    f.write("ok")
out["tmp"] = open("/tmp/strata-probe").read()
os.unlink("/tmp/strata-probe")
import tempfile
out["tempdir"] = tempfile.gettempdir()
print(json.dumps(out))
"""


def test_sidecar_read_only_root_and_reports_reach_the_operator(
    node_ns: tuple[LocalCluster, str, RealNode], request: pytest.FixtureRequest
) -> None:
    cluster, ns, _ = node_ns
    apply_policy(cluster, ns, "fast")
    run_id = f"{ns}.ro-{uuid.uuid4().hex[:4]}"
    begin = time.monotonic()
    create(cluster, ns, make_pod("trainer-ro", run_id, "fast"))
    pod = wait_running(cluster, ns, "trainer-ro")
    running_s = time.monotonic() - begin

    def ready() -> dict[str, Any] | None:
        p = kubectl_json(cluster, "-n", ns, "get", "pod", "trainer-ro")
        return p if condition(p, "Ready").get("status") == "True" else None

    pod = wait_for("the pod Ready", ready, timeout=240)
    ready_s = time.monotonic() - begin
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}["/tmp"] == TMP_VOLUME

    # Inside the running sidecar container: / is read-only, /tmp is writable and is Python's
    # temporary directory.
    out = cluster.kubectl(
        "-n", ns, "exec", "trainer-ro", "-c", SIDECAR_NAME, "--", "python", "-c", PROBE_FS
    )
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe == {"uid": 65532, "root": "EROFS", "tmp": "ok", "tempdir": "/tmp"}, probe

    # Its reports reach the operator over the bridge: the job appears in the policy's status
    # with the fresh start and the newest RAM and PVC steps the trainer saved.
    wait_for(
        "a save past the second PVC step",
        lambda: any(
            e["step"] >= 2 * PVC_EVERY + 1 for e in saved_events(cluster, ns, "trainer-ro")
        ),
        timeout=240,
    )
    reported_at = time.monotonic()

    def reported() -> dict[str, Any] | None:
        job = job_status(cluster, ns, "fast", run_id)
        steps = (job or {}).get("newestCompleteStep") or {}
        return job if steps.get("pvc", -1) >= PVC_EVERY and "ram" in steps else None

    try:
        job = wait_for("the pod's report in the policy status", reported, timeout=120)
    except AssertionError:
        raise AssertionError(
            f"no report of {run_id} in the policy status: {policy_status(cluster, ns, 'fast')}; "
            f"sidecar log:\n{cluster.kubectl('-n', ns, 'logs', 'trainer-ro', '-c', SIDECAR_NAME)}"
        ) from None
    report_s = time.monotonic() - reported_at
    saved = {e["step"] for e in saved_events(cluster, ns, "trainer-ro")}
    assert job["newestCompleteStep"]["ram"] in saved
    assert job["newestCompleteStep"]["pvc"] in saved
    assert job["newestCompleteStep"]["pvc"] % PVC_EVERY == 0
    assert job["lastRestore"]["outcome"] == "fresh-start", job
    assert "lastError" not in job, job
    pod = kubectl_json(cluster, "-n", ns, "get", "pod", "trainer-ro")
    assert container_status(pod, SIDECAR_NAME).get("restartCount") == 0
    report(
        request,
        f"injected pod: Running {running_s:.1f} s, Ready {ready_s:.1f} s after create; report in "
        f"the policy status {report_s:.1f} s after the PVC save was seen",
    )


# ----------------------------------------------------------------------------- HostPath RAM


@pytest.fixture
def node_tmpfs(tmp_path: Path) -> Any:
    """A 64 MiB tmpfs at a fresh directory (the node's RAM disk), unmounted afterwards."""
    path = tmp_path / "node-ram"
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "strata-e2e-ram", str(path)],
        check=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_hostpath_ram_survives_pod_deletion(
    node_ns: tuple[LocalCluster, str, RealNode],
    node_tmpfs: Path,
    request: pytest.FixtureRequest,
) -> None:
    cluster, ns, _ = node_ns
    apply_policy(cluster, ns, "hostram", medium="HostPath", host_path=str(node_tmpfs))
    run_id = f"{ns}.host-{uuid.uuid4().hex[:4]}"
    create(cluster, ns, make_pod("first", run_id, "hostram"))
    pod = wait_running(cluster, ns, "first")
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "strata-ram")
    assert vol["hostPath"]["path"] == str(node_tmpfs)
    wait_for(
        "a few RAM saves",
        lambda: len(saved_events(cluster, ns, "first")) >= 4,
        timeout=240,
    )
    # The node's tmpfs holds the job's RAM tier (written by the pod's sidecar and trainer).
    assert any(node_tmpfs.rglob("*")), "nothing written to the node's RAM disk"
    by_step = delete_pod_keeping_saves(cluster, ns, "first").saved
    newest = max(by_step)
    create(cluster, ns, make_pod("second", run_id, "hostram"))
    wait_running(cluster, ns, "second")
    restored = wait_restored_event(cluster, ns, "second")
    assert restored["tier"] == "ram", restored
    assert restored["step"] == newest, (restored, sorted(by_step))
    assert restored["weights_sha256"] == by_step[newest]
    cluster.kubectl("-n", ns, "delete", "pod", "second", "--wait=true", "--timeout=90s")
    report(
        request,
        f"HostPath RAM: the replacement restored step {restored['step']} from "
        f"{restored['tier']} in {restored['seconds']} s",
    )


# ----------------------------------------------------------------------------- too large


def ram_mount_size(node: RealNode, pod_uid: str) -> int:
    """Bytes of the tmpfs the kubelet mounted for the pod's strata-ram emptyDir."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, options, *_ = line.split()
        if pod_uid in target and target.endswith("/strata-ram") and fstype == "tmpfs":
            for opt in options.split(","):
                if opt.startswith("size="):
                    value = opt[5:]
                    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
                    if value[-1] in units:
                        return int(value[:-1]) * units[value[-1]]
                    return int(value)
    raise AssertionError(f"no tmpfs for pod {pod_uid}'s strata-ram under {node.directory}")


def test_state_larger_than_the_ram_tier_gets_a_clear_error(
    node_ns: tuple[LocalCluster, str, RealNode], request: pytest.FixtureRequest
) -> None:
    cluster, ns, node = node_ns
    apply_policy(cluster, ns, "small", size_limit="32Mi")
    run_id = f"{ns}.big-{uuid.uuid4().hex[:4]}"
    # 48 MiB of state: more than the 32 MiB tier even before the ring's keep + 1 slots.
    create(cluster, ns, make_pod("trainer-big", run_id, "small", args=("--ballast-mib", "48")))
    pod = wait_running(cluster, ns, "trainer-big")
    # The emptyDir's sizeLimit is the real size of the tmpfs the kubelet mounted.
    assert ram_mount_size(node, pod["metadata"]["uid"]) == 32 << 20

    def failed_saves() -> list[dict[str, Any]]:
        return [
            e
            for e in pod_events(cluster, ns, "trainer-big")
            if e["event"] == "saved" and not e["ok"]
        ]

    failures = wait_for("three failed saves", lambda: len(f := failed_saves()) >= 3 and f, 240)
    # What the trainer sees: save() returned False with Strata's message; training went on.
    assert not saved_events(cluster, ns, "trainer-big"), "a save of a too-large state succeeded"
    error = failures[0]["error"]
    assert "size limit" in error and "sizeLimit" in error, error
    assert str(32 << 20) in error, error
    # What the policy says: the job's last error (tier ram) and a TierFailed Event.
    job = wait_for(
        "the error in the policy status",
        lambda: (j := job_status(cluster, ns, "small", run_id)) and j.get("lastError") and j,
        timeout=120,
    )
    assert job["lastError"]["tier"] == "ram", job
    assert "sizeLimit" in job["lastError"]["message"], job
    events = wait_for(
        "a TierFailed Event on the policy",
        lambda: [
            e for e in policy_events(cluster, ns, "small") if e["reason"] == EVENT_TIER_FAILED
        ],
        timeout=60,
    )
    assert "sizeLimit" in events[0]["message"], events[0]
    # The pod is neither evicted nor restarted: the tmpfs never filled.
    pod = kubectl_json(cluster, "-n", ns, "get", "pod", "trainer-big")
    assert pod["status"]["phase"] == "Running", pod["status"]
    assert pod["status"].get("reason") != "Evicted"
    for name in ("trainer", SIDECAR_NAME):
        assert container_status(pod, name).get("restartCount") == 0, container_status(pod, name)
    report(request, f"state over the RAM tier: the trainer saw {error!r}")


# ----------------------------------------------------------------------------- two gloo ranks


def test_two_gloo_ranks_restore_after_one_is_killed(
    node_ns: tuple[LocalCluster, str, RealNode], request: pytest.FixtureRequest
) -> None:
    cluster, ns, node = node_ns
    apply_policy(cluster, ns, "fast")
    run_id = f"{ns}.gloo-{uuid.uuid4().hex[:4]}"
    env = {"WORLD_SIZE": "2", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth0"}
    # No cluster DNS: rank 1 finds rank 0 by its pod IP, which exists once its sandbox runs.
    create(
        cluster,
        ns,
        make_pod("rank-0", run_id, "fast", env={**env, "RANK": "0", "MASTER_ADDR": "127.0.0.1"}),
    )
    ip0 = wait_for(
        "rank 0's pod IP",
        lambda: (kubectl_json(cluster, "-n", ns, "get", "pod", "rank-0").get("status") or {}).get(
            "podIP"
        ),
        timeout=240,
    )
    create(
        cluster,
        ns,
        make_pod("rank-1", run_id, "fast", env={**env, "RANK": "1", "MASTER_ADDR": ip0}),
    )
    pods = {name: wait_running(cluster, ns, name) for name in ("rank-0", "rank-1")}
    assert pods["rank-1"]["status"]["podIP"] != ip0

    def both_saved(n: int) -> bool:
        return all(len(saved_events(cluster, ns, p)) >= n for p in pods)

    wait_for("three saves on both ranks", lambda: both_saved(3), timeout=300)
    for name, rank in (("rank-0", 0), ("rank-1", 1)):
        first = pod_events(cluster, ns, name)[0]
        assert first["event"] == "restored" and first["rank"] == rank and first["step"] is None
    cid = container_status(pods["rank-1"], "trainer")["containerID"].split("://", 1)[1]
    node.ctr("tasks", "kill", "-s", "SIGKILL", cid)
    killed = time.monotonic()

    def restarted(name: str) -> bool:
        p = kubectl_json(cluster, "-n", ns, "get", "pod", name)
        st = container_status(p, "trainer")
        return st.get("restartCount", 0) >= 1 and bool(st.get("state", {}).get("running"))

    wait_for("both trainers restarted", lambda: restarted("rank-0") and restarted("rank-1"), 240)
    saves = {p: saved_events(cluster, ns, p, previous=True) for p in pods}

    def restored(name: str) -> dict[str, Any] | None:
        return next((e for e in pod_events(cluster, ns, name) if e["event"] == "restored"), None)

    got = wait_for(
        "both ranks restored",
        lambda: (r := {p: restored(p) for p in pods}) and all(r.values()) and r,
        timeout=240,
    )
    restore_s = time.monotonic() - killed
    steps = {e["step"] for e in got.values()}
    assert len(steps) == 1, got
    (step,) = steps
    assert step is not None, got
    for name, ev in got.items():
        assert ev["tier"] == "ram", ev
        by_step = {e["step"]: e["weights_sha256"] for e in saves[name]}
        newest = max(by_step)
        assert step in (newest, newest - RAM_EVERY), (name, step, sorted(by_step))
        assert ev["weights_sha256"] == by_step[step], (name, ev)
    # The ranks all-reduce their gradients: both hold the same model.
    assert got["rank-0"]["weights_sha256"] == got["rank-1"]["weights_sha256"]
    # And they train on together after the restore.
    wait_for(
        "a save after the restore on both ranks",
        lambda: all(any(e["step"] > step for e in saved_events(cluster, ns, p)) for p in pods),
        timeout=180,
    )
    report(
        request,
        f"gloo over the bridge: both ranks restored step {step} from RAM "
        f"{restore_s:.1f} s after the kill",
    )
