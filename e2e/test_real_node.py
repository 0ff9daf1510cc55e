"""Real pods: a real kubelet and containerd (`e2e.node.harness`) joined to the local control plane,
running Strata's own images built from the project's Dockerfiles (`e2e.node.images`).

Real parts: everything of ``e2e/test_flow.py`` (apiserver, controller-manager, scheduler, the
operator as a subprocess whose webhook injects the sidecar) plus the kubelet v1.35.4, containerd,
runc, the CNI bridge, the sidecar and trainer images, and the kernel's tmpfs for the RAM tier (a
``medium: Memory`` emptyDir). The trainer is ``e2e/small_trainer.py`` in the trainer image with
torch from the host's site-packages mounted read-only (the image carries no torch). Flows:

* the injected pod: the sidecar is a native sidecar (init container, ``restartPolicy: Always``),
  non-root, and both containers run;
* SIGKILL of the trainer's process: the kubelet restarts the container and it restores from RAM
  the newest step it saved, with the bytes it saved;
* deletion of the pod: the replacement (a new pod of the same run id) restores from the PVC
  (a hostPath PV) the newest step, with the bytes saved.
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
from e2e.node.images import (
    IMAGES,
    BuiltImage,
    parse_dockerfile,
    substitute,
)
from e2e.node.story import (
    PVC_EVERY,
    SIDECAR_IMAGE,
    checkpoint_policy,
    container_status,
    delete_pod_keeping_saves,
    pod_events,
    saved_events,
    setup_pvc,
    sigkill_trainer_and_restore,
    trainer_pod,
    wait_for,
    wait_restored_event,
    wait_running,
)
from e2e.operator_fixtures import OperatorProcess

# Setting up the module's node (and, cold, building the images: `make images` does it before
# `make test`) takes minutes on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.real_node, pytest.mark.timeout(1500)]

# ----------------------------------------------------------------------------- images


def final_stage_instructions(dockerfile: Path) -> dict[str, Any]:
    """USER, ENTRYPOINT, LABELs and EXPOSEd ports the final stage of ``dockerfile`` declares."""
    out: dict[str, Any] = {"labels": {}, "exposed": [], "user": None, "entrypoint": None}
    for ins in parse_dockerfile(dockerfile.read_text()):
        if ins.keyword == "FROM":
            out = {"labels": {}, "exposed": [], "user": None, "entrypoint": None}
        elif ins.keyword == "USER":
            out["user"] = ins.args
        elif ins.keyword == "ENTRYPOINT":
            out["entrypoint"] = json.loads(ins.args)
        elif ins.keyword == "EXPOSE":
            out["exposed"] += [f"{p}/tcp" for p in ins.args.split()]
        elif ins.keyword == "LABEL":
            import shlex

            for word in shlex.split(ins.args):
                k, _, v = word.partition("=")
                out["labels"][k] = substitute(v, {})
    return out


def archive_config(archive: Path) -> dict[str, Any]:
    """The image config inside an OCI archive (index -> manifest -> config blob)."""
    import tarfile

    with tarfile.open(archive) as tar:

        def blob(digest: str) -> Any:
            f = tar.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
            assert f is not None
            return json.load(f)

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        index = json.load(index_file)
        manifest = blob(index["manifests"][0]["digest"])
        return dict(blob(manifest["config"]["digest"]))


@pytest.mark.parametrize("spec", IMAGES, ids=[s.name for s in IMAGES])
def test_image_config_matches_its_dockerfile(
    spec: Any,
    strata_images: dict[str, BuiltImage],  # noqa: F811
) -> None:
    img = strata_images[spec.name]
    declared = final_stage_instructions(REPO_ROOT / spec.dockerfile)
    config = archive_config(img.archive)["config"]
    assert declared["user"], f"{spec.dockerfile} sets no USER"
    assert config["User"] == declared["user"]
    assert config["Entrypoint"] == declared["entrypoint"]
    assert config.get("Labels") == declared["labels"]
    assert sorted(config.get("ExposedPorts") or {}) == sorted(declared["exposed"])
    assert any(e.startswith("PATH=/opt/strata/bin:") for e in config["Env"])


# ----------------------------------------------------------------------------- pods


def apply_policy(cluster: LocalCluster, ns: str) -> None:
    policy = checkpoint_policy("fast", namespace=ns, sidecar_image=SIDECAR_IMAGE)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))


@pytest.fixture
def flow(
    k8s_cluster: LocalCluster,
    k8s_namespace: str,
    real_node: RealNode,  # noqa: F811
    operator_running: OperatorProcess,
    tmp_path: Path,
) -> tuple[LocalCluster, str, RealNode]:
    setup_pvc(k8s_cluster, k8s_namespace, tmp_path / "pvc")
    apply_policy(k8s_cluster, k8s_namespace)
    return k8s_cluster, k8s_namespace, real_node


def test_injected_pod_sigkill_restores_from_ram(
    flow: tuple[LocalCluster, str, RealNode], request: pytest.FixtureRequest
) -> None:
    cluster, ns, node = flow
    run_id = f"{ns}.ram-{uuid.uuid4().hex[:4]}"
    name = "trainer-ram"
    begin = time.monotonic()
    cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(trainer_pod(name, run_id, 400)))
    pod = wait_running(cluster, ns, name)
    running_s = time.monotonic() - begin
    # Injected: a native sidecar, non-root, the RAM tier a Memory emptyDir.
    inits = {c["name"]: c for c in pod["spec"].get("initContainers") or []}
    sidecar = inits["strata-sidecar"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == SIDECAR_IMAGE
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    assert container_status(pod, "strata-sidecar").get("started") is True
    assert any((v.get("emptyDir") or {}).get("medium") == "Memory" for v in pod["spec"]["volumes"])
    # The trainer restores nothing (a fresh start) and saves to RAM.
    wait_for("three RAM saves", lambda: len(saved_events(cluster, ns, name)) >= 3, timeout=240)
    first = pod_events(cluster, ns, name)
    assert first[0]["event"] == "restored" and first[0]["step"] is None
    killed = sigkill_trainer_and_restore(cluster, ns, node, name, pod)
    restored = killed.restored
    _report(
        request,
        f"pod Running {running_s:.1f} s; kubelet restart after SIGKILL {killed.restart_s:.1f} s; "
        f"restored step {restored['step']} from {restored['tier']} in {restored['seconds']} s, "
        f"{killed.restore_s:.1f} s after the kill",
    )


def test_pod_delete_replacement_restores_from_pvc(
    flow: tuple[LocalCluster, str, RealNode], request: pytest.FixtureRequest
) -> None:
    cluster, ns, _ = flow
    run_id = f"{ns}.pvc-{uuid.uuid4().hex[:4]}"
    cluster.kubectl(
        "-n", ns, "create", "-f", "-", input=json.dumps(trainer_pod("first", run_id, 400))
    )
    wait_running(cluster, ns, "first")
    wait_for(
        "a save past the second PVC step",
        lambda: any(e["step"] >= 2 * PVC_EVERY + 1 for e in saved_events(cluster, ns, "first")),
        timeout=240,
    )
    deleted = delete_pod_keeping_saves(cluster, ns, "first")
    by_step = deleted.saved
    newest = max(by_step)
    cluster.kubectl(
        "-n", ns, "create", "-f", "-", input=json.dumps(trainer_pod("second", run_id, 400))
    )
    wait_running(cluster, ns, "second")
    restored = wait_restored_event(cluster, ns, "second")
    assert restored["tier"] == "pvc", restored
    assert restored["step"] == newest, (restored, sorted(by_step))
    assert restored["weights_sha256"] == by_step[newest]
    _report(
        request,
        f"pod deleted in {deleted.gone_s:.1f} s; replacement restored step {restored['step']} from "
        f"{restored['tier']} in {restored['seconds']} s",
    )


def _report(request: pytest.FixtureRequest, line: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[real node] {line}")
    print(line)
