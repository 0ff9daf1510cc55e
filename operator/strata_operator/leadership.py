"""Leader election of the operator's replicas: one ``coordination.k8s.io/v1`` Lease.

Why: the chart runs two replicas (``replicaCount: 2``) so that a lost pod (node drain, OOM, SIGKILL) does not stop the
admission webhook, whose ``failurePolicy: Fail`` refuses training pods while nobody answers. The
webhook is stateless and runs on EVERY replica (each keeps its own policy cache with its own LIST +
WATCH, :mod:`strata_operator.admission.policy_cache`, fresh on a standby too). What writes the
policies runs on ONE replica, the holder of the Lease: the reconcile (``status.conditions``, kopf's
progress and diff-base annotations, Events) and the report receiver (``status.jobs[]``, the
labelled-pod watch, ``NotProtected`` Events). Two writers would race on status and kopf's
annotations. kopf's own peering (1.45, ``_core/engines/peering.py``) was checked and not taken:
it is a static priority order, not an election (a replica pauses while a live peer has a higher
priority; equal priorities pause every replica, self included), so each replica would need a
distinct priority; a dead peer is noticed only when its entry's lifetime (60 s by default) runs
out; it needs the KopfPeering CRDs; and a paused kopf closes ALL its watch streams (the pod watch
of the receiver and the ``policy_event`` feed of the policy cache; the admission server, a task
without the pause toggle, keeps serving).

How (``strata_operator.main``): the leader-only roles get a kopf registry of their own, which
:class:`LeaderElector` runs as a second kopf operator, in a thread with its own event loop, while
this replica holds the Lease, and stops when it loses it. A new leader's kopf starts like a
restarted single operator: every policy is resumed (re-reconciled), retries and diffs left by the
previous leader are picked up from the policies' annotations.

The election is the Kubernetes client's ``kubernetes.leaderelection`` (a port of client-go's
leaderelection with a ``LeaseLock``; optimistic concurrency through the Lease's resourceVersion),
with three additions here, because it lacks them:

* release on graceful stop (client-go's ``ReleaseOnCancel``): the holder clears
  ``holderIdentity`` and sets ``leaseDurationSeconds: 1``, so the standby takes over within its
  ``retryPeriod`` instead of a whole ``leaseDuration``; a stopping elector never writes the Lease
  again (:class:`_FencedLeaseLock`), so its own renew loop cannot take back what it released;
* per-request timeouts on its API calls (it has none; a hung renew would outlive the lease);
* argument errors as ``ValueError`` (it calls ``sys.exit``).

Timing, as client-go's defaults (``leaseDuration`` 15 s, ``renewDeadline`` 10 s, ``retryPeriod``
2 s; https://pkg.go.dev/k8s.io/client-go/tools/leaderelection): a SIGKILLed leader is replaced
``leaseDuration`` after its last renewal, plus up to one ``retryPeriod``, plus the new leader's
kopf start (about a second). A leader that cannot renew for ``renewDeadline`` stops leading.

Reports that reach a standby: it does not listen on the report port (connection refused), which
the sidecar's reporter retries like a 503 (``strata.sidecar.reporter``, exponential backoff, a new
connection per attempt); the chart's ``reports`` Service selects only the pod labelled
``strata.dev/operator-role: leader``, which the leader sets on its own pod
(:func:`label_own_pod`) — the primary-Service pattern of CloudNativePG.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger("strata.leadership")

ROLE_LABEL = "strata.dev/operator-role"
"""Label of the operator pod's role: ``leader`` on the holder of the Lease, ``standby`` else."""
LEADER = "leader"
STANDBY = "standby"
REQUEST_TIMEOUT = (5.0, 5.0)
"""Connect and read timeouts of every Lease request, seconds; below ``renewDeadline``."""


@dataclass(frozen=True)
class ElectionTiming:
    """client-go's three durations, in whole seconds (the Lease stores whole seconds)."""

    lease_duration: int = 15
    """How long a standby waits after the last renewal it saw before it takes the Lease."""
    renew_deadline: int = 10
    """How long the leader retries a failed renewal before it stops leading."""
    retry_period: int = 2
    """Seconds between two attempts (renewals, or a standby's tries)."""

    def __post_init__(self) -> None:
        # The same rules as client-go's and the Python client's Config (which would sys.exit).
        if self.retry_period < 1:
            raise ValueError(f"retry period must be at least 1 s, not {self.retry_period}")
        if self.renew_deadline <= 1.2 * self.retry_period:
            raise ValueError(
                f"renew deadline ({self.renew_deadline} s) must exceed 1.2 x the retry period "
                f"({self.retry_period} s)"
            )
        if self.lease_duration <= self.renew_deadline:
            raise ValueError(
                f"lease duration ({self.lease_duration} s) must exceed the renew deadline "
                f"({self.renew_deadline} s)"
            )


def _lease_lock_class() -> type[Any]:
    from kubernetes.leaderelection.resourcelock import leaselock

    LeaseLock: Any = leaselock.LeaseLock  # untyped

    class _FencedLeaseLock(LeaseLock):  # type: ignore[misc]
        """The client's LeaseLock with request timeouts, a fence (no write once stopping) and
        the time of the last successful write (for :attr:`LeaderElector.is_leader`)."""

        def __init__(self, name: str, namespace: str, identity: str, api: Any) -> None:
            super().__init__(name, namespace, identity)
            self.api_instance = api
            self.stopping = threading.Event()
            self.written_at: float | None = None

        def create(self, name: str, namespace: str, election_record: Any) -> bool:
            if self.stopping.is_set():
                return False
            ok = bool(super().create(name, namespace, election_record))
            if ok:
                self.written_at = time.monotonic()
            return ok

        def update(self, name: str, namespace: str, updated_record: Any) -> bool:
            if self.stopping.is_set():
                return False
            ok = bool(super().update(name, namespace, updated_record))
            if ok:
                self.written_at = time.monotonic()
            return ok

    return _FencedLeaseLock


def _coordination_api() -> Any:
    """A CoordinationV1Api whose every request has :data:`REQUEST_TIMEOUT`."""
    from kubernetes import client

    api_client = client.ApiClient()
    original = api_client.call_api

    def call_api(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        return original(*args, **kwargs)

    api_client.call_api = call_api  # type: ignore[method-assign]
    return client.CoordinationV1Api(api_client)


class LeaderElector:
    """Campaign for the Lease ``namespace/name`` as ``identity``; while holding it, run ``lead``.

    ``lead(stop)`` runs in a thread of its own while this replica leads and must return soon after
    ``stop`` (a ``threading.Event``) is set: when the Lease is lost or :meth:`stop` is called.
    When ``lead`` returns or raises while still leading, ``on_failure`` is called (``main`` stops
    the whole operator: a leader that cannot lead must not keep the Lease).

    Call order: :meth:`start` once, then :meth:`stop` once (graceful: stop leading, wait for
    ``lead`` up to ``grace`` seconds, release the Lease).
    """

    def __init__(
        self,
        *,
        namespace: str,
        name: str,
        identity: str,
        lead: Callable[[threading.Event], None],
        timing: ElectionTiming | None = None,
        on_failure: Callable[[], None] | None = None,
        on_change: Callable[[bool], None] | None = None,
        api: Any = None,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing or ElectionTiming()
        self._lead = lead
        self._on_failure = on_failure
        self._on_change = on_change
        self._api = api if api is not None else _coordination_api()
        self._lock = _lease_lock_class()(name, namespace, identity, self._api)
        self._closing = threading.Event()
        self._lead_stop = threading.Event()
        self._leading = threading.Event()
        self._lead_done = threading.Event()
        self._lead_done.set()
        self._thread: threading.Thread | None = None
        self.transitions: list[tuple[float, bool]] = []
        """(time.time(), leading) of every change of this replica's role."""

    # --- state ------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Leading, and the Lease was written less than ``renewDeadline`` ago."""
        written = self._lock.written_at
        return (
            self._leading.is_set()
            and written is not None
            and time.monotonic() - written < self.timing.renew_deadline
        )

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start campaigning in a daemon thread (returns at once)."""
        logging.getLogger("leaderelection").setLevel(logging.WARNING)  # one line per retry
        self._thread = threading.Thread(
            target=self._campaign, name="strata-leader-election", daemon=True
        )
        self._thread.start()
        log.info(
            "campaigning for Lease %s/%s as %s (lease %d s, renew deadline %d s, retry %d s)",
            self.namespace,
            self.name,
            self.identity,
            self.timing.lease_duration,
            self.timing.renew_deadline,
            self.timing.retry_period,
        )

    def stop(self, grace: float = 20.0) -> None:
        """Stop leading (wait up to ``grace`` s for ``lead``), then release the Lease if held."""
        self._closing.set()
        self._lock.stopping.set()
        was_leading = self._leading.is_set()
        self._lead_stop.set()
        if not self._lead_done.wait(grace):
            log.warning("the leader's work did not stop within %.0f s", grace)
        if was_leading:
            self.release()

    def release(self) -> bool:
        """Give the Lease up if this replica still holds it (client-go's ReleaseOnCancel):
        holder cleared, ``leaseDurationSeconds`` 1. Returns whether it was released."""
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return False
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = datetime.now(UTC)
            self._api.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)
            return False
        except Exception as exc:  # a network error must not block the shutdown
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)
            return False
        log.info("released Lease %s/%s", self.namespace, self.name)
        return True

    # --- the election thread ----------------------------------------------------------------

    def _campaign(self) -> None:
        from kubernetes.leaderelection import electionconfig, leaderelection

        Config: Any = electionconfig.Config  # untyped
        LeaderElection: Any = leaderelection.LeaderElection
        timing = self.timing
        while not self._closing.is_set():
            config = Config(
                self._lock,
                timing.lease_duration,
                timing.renew_deadline,
                timing.retry_period,
                self._started_leading,
                self._stopped_leading,
            )
            try:
                LeaderElection(config).run()
            except Exception:  # campaign again rather than die silently
                log.exception("leader election failed; campaigning again")
            if not self._closing.is_set():
                self._closing.wait(timing.retry_period)

    def _set_leading(self, leading: bool) -> None:
        if leading:
            self._leading.set()
        else:
            self._leading.clear()
        self.transitions.append((time.time(), leading))
        if self._on_change is not None:
            try:
                self._on_change(leading)
            except Exception:  # a label patch must not break the election
                log.exception("role change callback failed")

    def _started_leading(self) -> None:
        """Runs in a thread of the election library while this replica holds the Lease."""
        if self._closing.is_set():
            return
        log.info("leading: Lease %s/%s held by %s", self.namespace, self.name, self.identity)
        self._lead_stop.clear()
        self._lead_done.clear()
        self._set_leading(True)
        failed = False
        try:
            self._lead(self._lead_stop)
        except Exception:
            log.exception("the leader's work failed")
            failed = True
        finally:
            self._lead_done.set()
        if not self._lead_stop.is_set() or failed:
            # The work ended by itself: keep no Lease that protects nothing.
            log.error("the leader's work ended while leading; stopping the operator")
            if self._on_failure is not None:
                self._on_failure()
            raise RuntimeError("the leader's work ended while leading")

    def _stopped_leading(self) -> None:
        """The library's renew loop ended: the Lease was lost (or :meth:`stop`, or a failure)."""
        if self._leading.is_set():
            log.warning(
                "stopped leading: Lease %s/%s not renewed within %d s",
                self.namespace,
                self.name,
                self.timing.renew_deadline,
            )
        self._lead_stop.set()
        if not self._lead_done.wait(self.timing.lease_duration):
            log.error("the leader's work did not stop; stopping the operator")
            if self._on_failure is not None:
                self._on_failure()
        if self._leading.is_set():
            self._set_leading(False)


def label_own_pod(core_api: Any, namespace: str, pod: str, role: str) -> None:
    """Set :data:`ROLE_LABEL` to ``role`` on the operator's own pod (the reports Service selects
    the leader by it). Raises the client's ApiException."""
    core_api.patch_namespaced_pod(
        pod,
        namespace,
        {"metadata": {"labels": {ROLE_LABEL: role}}},
        _request_timeout=REQUEST_TIMEOUT,
    )
