"""Per-pod cost of building the injection patch of a pod under a ``spec.peers`` policy.

Prints, for Indexed Jobs of several sizes, the time of one :func:`build_pod_patch` call and the
size of the ``STRATA_CONFIG`` it carries (the peer list travels in it), side by side. Offline:
no cluster. ``python -m bench.peer_admission [--sizes 4000,20000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from strata_operator.admission.mutation import InjectionError, InjectionSettings, build_pod_patch


def _pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-0-abcde",
            "namespace": "team-a",
            "labels": {"strata.dev/policy": "fast", "batch.kubernetes.io/job-name": "train"},
        },
        "spec": {"containers": [{"name": "train", "image": "python:3.11-slim"}]},
    }


def _job(n: int) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "namespace": "team-a"},
        "spec": {"completions": n, "parallelism": n, "completionMode": "Indexed"},
    }


def _policy() -> dict[str, Any]:
    return {
        "metadata": {"name": "fast", "namespace": "team-a"},
        "spec": {"tiers": {"ram": {"sizeLimit": "2Gi", "keep": 2}}, "peers": {"copies": 1}},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,4000,20000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    settings = InjectionSettings(sidecar_image="strata:bench")
    print(f"{'peers':>8} {'ms/pod (best)':>14} {'STRATA_CONFIG bytes':>20}  outcome")
    for n in (int(s) for s in args.sizes.split(",")):
        best, size, outcome = float("inf"), 0, "injected"
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            try:
                ops = build_pod_patch(_pod(), _policy(), settings, workload=_job(n))
            except InjectionError as exc:
                outcome = f"refused: {str(exc)[:60]}..."
                ops = []
            best = min(best, time.perf_counter() - t0)
        for op in ops:
            text = json.dumps(op)
            if "STRATA_CONFIG" in text and op["path"].startswith("/spec/containers"):
                size = max(size, len(text))
        print(f"{n:>8} {best * 1000:>14.1f} {size:>20}  {outcome}")


if __name__ == "__main__":
    main()
