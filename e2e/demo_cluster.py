"""``make demo-cluster``: the Kubernetes half of ``make demo`` on a real node, Strata installed by
its chart.

`e2e.node.stack.OperatorPodStack` brings up a local control plane, a real kubelet + containerd
node and ``helm install`` of ``charts/strata`` with the operator image built by ``make images``;
then, in namespace ``demo``, a fake-gcs-server on the node's bridge gateway (the pods' way to it:
``tiers.gcs.endpoint``), a CheckpointPolicy (RAM every 2 steps, PVC every 4, GCS every 8, a
hostPath PV) and one training pod (``e2e/small_trainer.py`` in the trainer image, torch from the
host) that the operator pod's webhook injects with the checkpoint sidecar:

1. **ram**: the trainer's process is SIGKILLed; the kubelet restarts the container, and it
   restores the newest step saved from the pod's RAM tier (a ``medium: Memory`` emptyDir);
2. **pvc**: the pod is deleted (its RAM goes with it; the sidecar flushes the newest step to the
   PVC on SIGTERM); a replacement pod of the same run restores that step from the PVC;
3. **gcs**: that pod is deleted too and the PVC's contents are wiped (RAM and PVC lost); the next
   replacement restores the newest complete step in the bucket.

Each restore is checked against what the trainer saved (step and sha256 of the weights), and
the operator pod's view is shown: the restore folded into the policy's ``status.jobs[]`` from
the sidecar's reports. Prints a table; exit status 0 only when every check held. Everything is
torn down at the end (nothing is left on the machine). No loss plot here: the test trainer
trains nothing worth plotting (``make demo`` has the plot).

Usage: ``python -m e2e.demo_cluster`` (root; ``make tools images`` first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.node.stack import OperatorPodStack
from e2e.node.story import (
    PVC_EVERY,
    checkpoint_policy,
    delete_pod_keeping_saves,
    saved_events,
    setup_pvc,
    sigkill_trainer_and_restore,
    trainer_pod,
    wait_for,
    wait_restore_folded,
    wait_restored_event,
    wait_running,
)
from strata.config import GcsTierConfig
from strata.testing.emulator import FakeGcsServer
from strata.tiers.gcs import GcsTier
from strata_operator.constants import POLICY_LABEL

POLICY = "demo"
BUCKET = "strata-demo"
GCS_EVERY = 2 * PVC_EVERY
EXPECTED_TIERS = ["ram", "pvc", "gcs"]


@dataclass
class Recovery:
    """One recovery of the story: what failed, the tier and step restored, the seconds of the
    restore itself and from the failure to the restored event, whether the bytes are the ones
    saved, and the restore as the operator folded it into the policy status."""

    failure: str
    tier: str
    step: int
    restore_s: float
    since_failure_s: float
    bytes_match: bool
    status: dict[str, Any]


def _pod(stack: OperatorPodStack, name: str, run_id: str, steps: int) -> dict[str, Any]:
    pod = trainer_pod(name, run_id, steps)
    pod["metadata"]["labels"][POLICY_LABEL] = POLICY
    pod["spec"]["hostAliases"] = stack.host_aliases()
    return pod


def demo_policy(gcs_endpoint: str) -> dict[str, Any]:
    """The stories' policy (`checkpoint_policy`) plus the GCS tier: bucket `BUCKET` behind
    ``gcs_endpoint``, every `GCS_EVERY` steps, keep 2."""
    policy = checkpoint_policy(POLICY)
    policy["spec"]["tiers"]["gcs"] = {
        "bucket": BUCKET,
        "endpoint": gcs_endpoint,
        "every": {"steps": GCS_EVERY},
        "keep": 2,
    }
    return policy


def run_story(stack: OperatorPodStack, ns: str, pvc_dir: Path, log: Any = print) -> list[Recovery]:
    """The story in namespace ``ns`` (created here) with the PV at ``pvc_dir`` and a
    fake-gcs-server of its own on the bridge gateway (stopped on return); returns the
    recoveries in order. Raises AssertionError when a check fails."""
    with FakeGcsServer(host=stack.node.gateway) as gcs:
        gcs.client(project="demo").create_bucket(BUCKET)
        log(f"[demo-cluster] fake-gcs-server at {gcs.endpoint} (the pods reach it on the bridge)")
        return _story(stack, ns, pvc_dir, gcs, log)


def newest_gcs_step(gcs: FakeGcsServer, job_id: str) -> int | None:
    """The newest step of ``job_id`` whose every rank is committed in the bucket."""
    config = GcsTierConfig(bucket=BUCKET, endpoint=gcs.endpoint)
    with GcsTier(config, writer_id="demo-cluster", retry_timeout=30.0) as tier:
        return tier.newest_complete_step(job_id)


def _conditions(stack: OperatorPodStack, ns: str) -> dict[str, str]:
    obj = stack.kubectl_json("-n", ns, "get", "checkpointpolicy", POLICY)
    conditions = (obj.get("status") or {}).get("conditions") or []
    return {c["type"]: c["status"] for c in conditions if c["type"] in ("Ready", "Degraded")}


def _story(
    stack: OperatorPodStack, ns: str, pvc_dir: Path, gcs: FakeGcsServer, log: Any
) -> list[Recovery]:
    cluster = stack.cluster
    stack.create_namespace(ns)
    setup_pvc(cluster, ns, pvc_dir)
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(demo_policy(gcs.endpoint)))
    # The operator pod checks the bucket where the sidecar will write (tiers.gcs.endpoint):
    # Degraded False only once that check answered "ok".
    wait_for(
        "the policy Ready and not Degraded (the operator pod found the bucket at the endpoint)",
        lambda: _conditions(stack, ns) == {"Ready": "True", "Degraded": "False"},
        timeout=120,
    )
    run_id = f"{ns}.charlm-{uuid.uuid4().hex[:4]}"
    out: list[Recovery] = []

    # --- 1. the trainer's process SIGKILLed: restored from the pod's RAM
    log("[demo-cluster] creating the training pod (injected by the operator pod's webhook)")
    cluster.kubectl(
        "-n", ns, "create", "-f", "-", input=json.dumps(_pod(stack, "train-0", run_id, 2000))
    )
    pod = wait_running(cluster, ns, "train-0")
    wait_for("three RAM saves", lambda: len(saved_events(cluster, ns, "train-0")) >= 3, 240)
    log("[demo-cluster] SIGKILL of the trainer's process")
    killed = sigkill_trainer_and_restore(cluster, ns, stack.node, "train-0", pod)
    r = killed.restored
    out.append(
        Recovery(
            "trainer SIGKILLed",
            r["tier"],
            r["step"],
            float(r["seconds"]),
            killed.restore_s,
            r["weights_sha256"] == killed.saved[r["step"]],
            wait_restore_folded(stack, ns, POLICY, run_id, r["step"]),
        )
    )

    # --- 2. the pod deleted (its RAM with it): the replacement restores from the PVC
    after = r["step"]
    wait_for(
        "a PVC step saved after the restore",
        lambda: any(
            e["step"] >= after + PVC_EVERY + 1 for e in saved_events(cluster, ns, "train-0")
        ),
        timeout=240,
    )
    log("[demo-cluster] deleting the pod (its RAM tier goes with it)")
    deleted = delete_pod_keeping_saves(cluster, ns, "train-0")
    by_step = deleted.saved
    newest = max(by_step)
    log("[demo-cluster] creating the replacement pod")
    out.append(
        _replacement_restores(
            stack,
            ns,
            "train-1",
            run_id,
            "pvc",
            newest,
            by_step,
            deleted.asked_at,
            "pod deleted (RAM lost)",
        )
    )

    # --- 3. that pod deleted and the PVC wiped (RAM and PVC lost): restored from GCS
    after = out[-1].step
    wait_for(
        "a GCS step saved after the PVC restore",
        lambda: (newest_gcs_step(gcs, run_id) or 0) > after,
        timeout=300,
    )
    log("[demo-cluster] deleting the replacement pod, then wiping the PVC")
    deleted = delete_pod_keeping_saves(cluster, ns, "train-1")
    by_step.update(deleted.saved)
    for child in pvc_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    expected = newest_gcs_step(gcs, run_id)
    assert expected is not None and expected > after, (expected, after)
    log(f"[demo-cluster] the bucket's newest complete step: {expected}; creating the next pod")
    out.append(
        _replacement_restores(
            stack,
            ns,
            "train-2",
            run_id,
            "gcs",
            expected,
            by_step,
            deleted.asked_at,
            "pod deleted, PVC wiped (RAM and PVC lost)",
        )
    )
    with contextlib.suppress(Exception):  # its trainer would keep a core busy afterwards
        cluster.kubectl("-n", ns, "delete", "pod", "train-2", "--wait=false", check=False)
    return out


def _replacement_restores(
    stack: OperatorPodStack,
    ns: str,
    pod: str,
    run_id: str,
    tier: str,
    step: int,
    saved: dict[int, str],
    failed_at: float,
    failure: str,
) -> Recovery:
    """Create ``pod`` of run ``run_id`` and check that it restores ``step`` from ``tier`` with
    the weights ``saved`` at that step; the Recovery as the operator pod folded it."""
    cluster = stack.cluster
    cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(_pod(stack, pod, run_id, 2000)))
    wait_running(cluster, ns, pod)
    restored = wait_restored_event(cluster, ns, pod, f"{pod}'s restored event")
    assert restored["tier"] == tier, restored
    assert restored["step"] == step, (restored, sorted(saved))
    return Recovery(
        failure,
        restored["tier"],
        restored["step"],
        float(restored["seconds"]),
        time.monotonic() - failed_at,
        restored["weights_sha256"] == saved.get(step),
        wait_restore_folded(stack, ns, POLICY, run_id, restored["step"]),
    )


def table(recoveries: list[Recovery]) -> str:
    rows = [("failure", "tier", "step", "restore s", "since failure s", "bytes", "status says")]
    for r in recoveries:
        last = r.status.get("lastRestore") or {}
        rows.append(
            (
                r.failure,
                r.tier,
                str(r.step),
                f"{r.restore_s:.3f}",
                f"{r.since_failure_s:.1f}",
                "identical" if r.bytes_match else "DIFFER",
                f"step {last.get('step')} from {last.get('tier')}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo_cluster", description=__doc__)
    parser.parse_args(argv)
    from e2e.cluster import Binaries, BinariesMissing
    from e2e.node.harness import NodeUnavailable, missing_prerequisites
    from e2e.node.images import IMAGES, ImageBuildError, build_image

    try:
        binaries = Binaries.locate()
    except BinariesMissing as exc:
        print(f"demo-cluster: {exc}", file=sys.stderr)
        return 2
    missing = missing_prerequisites(binaries.bin_dir)
    if missing or not (binaries.bin_dir / "helm").is_file():
        print(f"demo-cluster needs: {'; '.join(missing) or 'helm (make tools)'}", file=sys.stderr)
        return 2
    try:
        images = {spec.name: build_image(spec) for spec in IMAGES}
    except ImageBuildError as exc:
        print(f"demo-cluster: an image failed to build ({exc}); run make images", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="strata-demo-cluster-") as tmp:
        stack = OperatorPodStack(
            Path(tmp), images, binaries, log=lambda msg: print(f"[demo-cluster] {msg}")
        )
        print("[demo-cluster] control plane, real node, helm install of charts/strata ...")
        try:
            stack.start()
        except NodeUnavailable as exc:
            print(f"demo-cluster: {exc}", file=sys.stderr)
            return 2
        took = ", ".join(f"{k} at {v:.0f} s" for k, v in stack.timings.items())
        print(f"[demo-cluster] up: {took}; operator pod {stack.operator_pod['metadata']['name']}")
        try:
            recoveries = run_story(stack, "demo", Path(tmp) / "pvc")
            ok = (
                all(r.bytes_match for r in recoveries)
                and [r.tier for r in recoveries] == EXPECTED_TIERS
            )
        except AssertionError as exc:
            print(f"[demo-cluster] FAILED: {exc}", file=sys.stderr)
            recoveries, ok = [], False
        finally:
            print("[demo-cluster] tearing down")
            stack.stop()
        left = stack.leftovers()
    if recoveries:
        print(table(recoveries))
    if left:
        print(f"[demo-cluster] left on the machine: {left}", file=sys.stderr)
    print("[demo-cluster] every check held" if ok and not left else "[demo-cluster] FAILED")
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
