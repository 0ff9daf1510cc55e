"""Which policies depend on which objects, so that a fixed dependency is re-checked at once.

A policy waiting for its PVC (or its credentials Secret) is Ready=False and kopf retries it after
``--dependency-retry`` seconds; creating the PVC does not touch the policy, so without help its
status would stay stale until that retry. The operator watches PVCs (and, with ``--watch-secrets``,
Secrets), looks up the policies that name the changed object here, and reconciles them right away
(:meth:`strata_operator.reconcile.handlers.PolicyReconciler.recheck_dependents`).

Rule of this module: pure bookkeeping (no Kubernetes calls, no kopf); thread-safe, because kopf
runs the synchronous reconcile handler in worker threads.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Final, Literal

from strata_operator.api import CheckpointPolicySpec

PVC: Final = "PersistentVolumeClaim"
SECRET: Final = "Secret"
Kind = Literal["PersistentVolumeClaim", "Secret"]
ObjectKey = tuple[str, Kind, str]
"""(namespace, kind, name) of a dependency."""
PolicyKey = tuple[str, str]
"""(namespace, name) of a policy."""


def dependencies_of(spec: CheckpointPolicySpec) -> set[tuple[Kind, str]]:
    """The objects in the policy's namespace whose existence decides its Ready condition."""
    deps: set[tuple[Kind, str]] = set()
    if spec.tiers.pvc is not None:
        deps.add((PVC, spec.tiers.pvc.claim_name))
    gcs = spec.tiers.gcs
    if gcs is not None and gcs.credentials.secret_ref is not None:
        deps.add((SECRET, gcs.credentials.secret_ref.name))
    return deps


class DependencyIndex:
    """policy -> dependencies and back; plus one lock per policy so that the kopf handler and a
    dependency re-check never reconcile the same policy at the same time."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._by_policy: dict[PolicyKey, set[ObjectKey]] = {}
        self._by_object: dict[ObjectKey, set[str]] = defaultdict(set)
        self._locks: dict[PolicyKey, threading.Lock] = {}

    def record(self, namespace: str, policy: str, spec: CheckpointPolicySpec | None) -> None:
        """Replace what ``policy`` depends on (``None``: nothing, e.g. an invalid spec)."""
        new = {(namespace, kind, name) for kind, name in dependencies_of(spec)} if spec else set()
        with self._mutex:
            for obj in self._by_policy.pop((namespace, policy), set()) - new:
                self._by_object[obj].discard(policy)
                if not self._by_object[obj]:
                    del self._by_object[obj]
            for obj in new:
                self._by_object[obj].add(policy)
            if new:
                self._by_policy[(namespace, policy)] = new

    def forget(self, namespace: str, policy: str) -> None:
        self.record(namespace, policy, None)
        with self._mutex:
            self._locks.pop((namespace, policy), None)

    def dependents(self, namespace: str, kind: Kind, name: str) -> list[str]:
        """Names of the policies in ``namespace`` that depend on this object (sorted)."""
        with self._mutex:
            return sorted(self._by_object.get((namespace, kind, name), ()))

    def lock(self, namespace: str, policy: str) -> threading.Lock:
        with self._mutex:
            return self._locks.setdefault((namespace, policy), threading.Lock())
