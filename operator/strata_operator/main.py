"""The operator's command line and composition root: ``strata operator [flags]``.

``strata operator [flags]`` and ``python -m strata_operator [flags]`` both call :func:`run`.

Rule: the only module that knows every role. It lists the roles as
:class:`strata_operator.extension.Extension` objects (:func:`default_extensions`: reconcile,
admission webhook, report receiver), builds what they share
(:class:`~strata_operator.extension.Wiring`: the TLS files of the HTTPS servers, where sidecars send
reports), configures each, lets each register its kopf handlers into one explicit
``kopf.OperatorRegistry``, and runs kopf with it. Nothing is registered by importing a module.

Kopf settings (:func:`tune_kopf`): progress and diff-base in ``strata.dev/*`` annotations (the
diff base is a digest of the spec, see :class:`GenerationDiffBaseStorage`); nothing in status,
handler results are not stored (the handlers return None); no finalizers — kopf adds one only
for non-optional deletion handlers and daemons/timers, and none are registered (case C-13:
deleting a namespace must never wait for the operator); kopf's own log lines are not posted as
Events (only CRITICAL ones), so a policy waiting for its PVC does not collect an Event per retry.
Pods: kopf watches only pods labelled ``strata.dev/policy`` (a server-side label selector), so
the operator's memory does not grow with the cluster's other pods.

Replicas (``--leader-elect``, :mod:`strata_operator.leadership`): the roles whose ``leader_only``
is true (reconcile, reports) register into a second registry that a second kopf operator runs only
while this replica holds the Lease; the others (admission) and the election itself stay in the
first, which every replica runs. Without the flag (one replica, the local e2e operator) every role
is in the one registry, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import kopf

from strata_operator import certs, leadership, memory
from strata_operator.admission.webhook import Webhook
from strata_operator.constants import FINALIZER, PERSISTENCE_PREFIX, POLICY_LABEL
from strata_operator.extension import Extension, ReportEndpoint, Wiring
from strata_operator.logs import ENV_LOG_FORMAT, LOG_FORMATS, setup_logging
from strata_operator.reconcile.handlers import PolicyReconciler
from strata_operator.reports.receiver import ReportReceiver


def default_extensions() -> list[Extension]:
    """The operator's roles, in configuration order: reconcile, admission webhook, reports."""
    return [PolicyReconciler(), Webhook(), ReportReceiver()]


class GenerationDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled-configuration annotation, holding a digest instead of the object.

    kopf decides "update" by comparing an object's *essence* with the last *successfully
    handled* one, which it stores as JSON in an annotation. Two changes to kopf's default:

    * The essence is ``metadata.generation`` plus the SHA-256 of the spec (about 120 bytes),
      not a copy of the spec, labels and annotations: a copy doubles the object's annotations,
      so a policy whose annotations (or spec) exceed half of Kubernetes' 256 KiB annotation
      limit could never be marked handled, and kopf would retry it forever. Labels and
      annotations do not change what the reconcile decides, so they are not part of it.
    * With the generation in the essence every spec change, reverts included, is an update:
      when a user breaks a policy (the handler is retrying) and reverts it before the retry,
      the spec equals the last handled one again and kopf would drop the pending update, leaving
      status at the broken generation forever.
    """

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        spec = json.dumps(body.get("spec") or {}, sort_keys=True, separators=(",", ":"))
        essence: dict[str, Any] = {"spec": {"sha256": hashlib.sha256(spec.encode()).hexdigest()}}
        generation = body.get("metadata", {}).get("generation")
        if generation is not None:
            essence["metadata"] = {"generation": generation}
        return cast(kopf.BodyEssence, essence)


def tune_kopf(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf's startup handler of the operator: persistence, posting and watch settings."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=PERSISTENCE_PREFIX
    )
    settings.persistence.diffbase_storage = GenerationDiffBaseStorage(
        prefix=PERSISTENCE_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    # kopf would post its own log lines as Events, including "failed temporarily" on every
    # retry of a missing dependency; our Events (on a Ready change) already say it once.
    settings.posting.level = logging.CRITICAL
    # Only labelled pods are watched (server-side selector): the operator's memory and its
    # start-up list do not grow with the cluster's other pods.
    settings.watching.label_selectors["", "v1", "pods"] = POLICY_LABEL
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    settings.execution.max_workers = 8


# --- command line -----------------------------------------------------------------------------


def build_parser(extensions: Sequence[Extension] | None = None) -> argparse.ArgumentParser:
    """The operator's flags: its own (scope, kubeconfig, logging, TLS) and every extension's
    (``extensions`` None: :func:`default_extensions`)."""
    parser = argparse.ArgumentParser(
        prog="strata operator",
        description="Run the Strata operator (reconciles CheckpointPolicies).",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; kopf glob patterns allowed)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (default)"
    )
    parser.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, then in-cluster config)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=os.environ.get("STRATA_OPERATOR_LIVENESS"),
        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8090/healthz (default: off)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    parser.add_argument("--debug", action="store_true", help="log at DEBUG")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get(ENV_LOG_FORMAT) or "json",
        help=f"json: one JSON object per line, like the sidecar's; text: kopf's plain lines "
        f"(default: ${ENV_LOG_FORMAT}, else json)",
    )
    tls = parser.add_argument_group("TLS of the webhook and the report receiver")
    tls.add_argument(
        "--tls-dir",
        type=Path,
        help="directory of a mounted kubernetes.io/tls secret (tls.crt, tls.key, ca.crt); "
        "default: generate a CA and certificate at start",
    )
    tls.add_argument(
        "--tls-workdir",
        type=Path,
        help="where generated certificates are written (default: a new temporary directory)",
    )
    tls.add_argument(
        "--tls-san",
        action="append",
        default=[],
        help="extra DNS name or IP for the generated certificate (repeatable)",
    )
    election = parser.add_argument_group("leader election (several replicas)")
    election.add_argument(
        "--leader-elect",
        action="store_true",
        help="run the reconcile and the report receiver only while holding a Lease, so that "
        "several replicas can serve the webhook (default: off, one replica does everything)",
    )
    election.add_argument(
        "--leader-election-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="namespace of the Lease (default $POD_NAMESPACE, else --operator-namespace)",
    )
    election.add_argument(
        "--leader-election-name", default="strata-operator", help="name of the Lease"
    )
    election.add_argument(
        "--leader-election-identity",
        default=os.environ.get("POD_NAME"),
        help="this replica's holderIdentity (default $POD_NAME, else host_pid_random)",
    )
    timing = leadership.ElectionTiming()
    election.add_argument(
        "--lease-duration",
        type=int,
        default=timing.lease_duration,
        metavar="SECONDS",
        help="a standby takes the Lease this long after the leader's last renewal "
        "(default %(default)s, client-go's)",
    )
    election.add_argument(
        "--renew-deadline",
        type=int,
        default=timing.renew_deadline,
        metavar="SECONDS",
        help="the leader stops leading when it could not renew for this long (default %(default)s)",
    )
    election.add_argument(
        "--retry-period",
        type=int,
        default=timing.retry_period,
        metavar="SECONDS",
        help="seconds between renewals and between a standby's tries (default %(default)s)",
    )
    for ext in default_extensions() if extensions is None else extensions:
        ext.add_arguments(parser)
    return parser


def _sans(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """DNS names and IPs of the generated certificate: localhost, the webhook's host and
    Service names, and every ``--tls-san``."""
    names = {"localhost", args.webhook_host, *args.tls_san}
    if args.webhook_service:
        ns, _, rest = args.webhook_service.partition("/")
        svc = rest.partition(":")[0]
        names |= {f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"}
    dns, ips = [], ["127.0.0.1"]
    for n in names:
        try:
            ipaddress.ip_address(n)
            ips.append(n)
        except ValueError:
            dns.append(n)
    return tuple(sorted(set(dns))), tuple(sorted(set(ips)))


def build_wiring(args: argparse.Namespace) -> Wiring:
    """What the roles share: the TLS files (mounted or generated) and the report endpoint
    (``--report-url``, else ``https://<--webhook-host>:<--report-port>``; None with port 0)."""
    dns, ips = _sans(args)
    workdir = args.tls_workdir or Path(tempfile.mkdtemp(prefix="strata-operator-tls-"))
    tls = certs.load_or_generate(workdir, tls_dir=args.tls_dir, dns_names=dns, ip_addresses=ips)
    url = args.report_url
    if url is None and args.report_port:
        url = f"https://{args.webhook_host}:{args.report_port}"
    report = None if url is None else ReportEndpoint(url=url, audience=args.report_audience)
    return Wiring(tls=tls, report=report)


def use_kubeconfig(path: str) -> None:
    """Make every later ``kubernetes.config.load_config()`` (ours, kopf's, the extensions') and
    kopf's login read ``path``.

    The kubernetes client reads ``$KUBECONFIG`` once, at import, into
    ``KUBE_CONFIG_DEFAULT_LOCATION`` (also re-exported by ``kubernetes.config``), and kopf imports
    it before any flag is parsed; so the module globals are updated along with the variable.
    """
    os.environ["KUBECONFIG"] = path
    for name in ("kubernetes.config", "kubernetes.config.kube_config"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "KUBE_CONFIG_DEFAULT_LOCATION"):
            setattr(module, "KUBE_CONFIG_DEFAULT_LOCATION", path)  # noqa: B010


def _base_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    # kopf's implicit default registry logs in this way; an explicit registry says so itself.
    kopf.on.login(id="login_via_client", registry=registry)(kopf.login_via_client)
    kopf.on.startup(id="tune_kopf", registry=registry)(tune_kopf)
    return registry


def build_registry(
    args: argparse.Namespace, wiring: Wiring, extensions: Sequence[Extension]
) -> kopf.OperatorRegistry:
    """A fresh kopf registry holding the operator's own handlers (login through the kubernetes
    client's configuration, :func:`tune_kopf`) and, after configuring each, every extension's."""
    registry = _base_registry()
    for ext in extensions:
        ext.configure(args, wiring)
        ext.register(registry)
    return registry


def build_registries(
    args: argparse.Namespace, wiring: Wiring, extensions: Sequence[Extension]
) -> tuple[kopf.OperatorRegistry, kopf.OperatorRegistry]:
    """With ``--leader-elect``: (the registry every replica runs, the leader's registry). Each
    holds the operator's own handlers; every extension is configured, in list order, and
    registers into the leader's registry when it is ``leader_only``, else into the first."""
    everyone, leader = _base_registry(), _base_registry()
    for ext in extensions:
        ext.configure(args, wiring)
        ext.register(leader if ext.leader_only else everyone)
    return everyone, leader


def election_identity(args: argparse.Namespace) -> str:
    """``--leader-election-identity``, else ``<host>_<pid>_<random>`` (unique per process)."""
    if args.leader_election_identity:
        return str(args.leader_election_identity)
    return f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def run_until(stop: threading.Event, **kwargs: Any) -> None:
    """``kopf.operator(**kwargs)`` in a new event loop until SIGINT/SIGTERM (in the main thread)
    or ``stop``. kopf itself would wait for a ``threading.Event`` (or a concurrent future) on a
    thread of the loop's default executor and then wait for that thread at exit, forever; here a
    daemon thread of our own relays it into an asyncio future."""
    import asyncio

    async def operate() -> None:
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not stopped.done():
                stopped.set_result(None)

        def relay() -> None:
            stop.wait()
            loop.call_soon_threadsafe(wake)

        threading.Thread(target=relay, name="strata-stop-relay", daemon=True).start()
        await kopf.operator(stop_flag=stopped, **kwargs)

    with contextlib.suppress(asyncio.CancelledError):  # as kopf.run
        asyncio.run(operate())


class ElectedOperator:
    """The leader's kopf operator, run by a :class:`strata_operator.leadership.LeaderElector`
    while this replica holds the Lease; started and stopped by the first registry's startup and
    cleanup handlers."""

    def __init__(
        self,
        args: argparse.Namespace,
        registry: kopf.OperatorRegistry,
        process_stop: threading.Event,
    ) -> None:
        self.args = args
        self.registry = registry
        self.process_stop = process_stop
        self.failed = False
        namespace = args.leader_election_namespace or args.operator_namespace
        self.pod = os.environ.get("POD_NAME") if os.environ.get("POD_NAMESPACE") else None
        self.pod_namespace = os.environ.get("POD_NAMESPACE")
        self.elector = leadership.LeaderElector(
            namespace=namespace,
            name=args.leader_election_name,
            identity=election_identity(args),
            timing=leadership.ElectionTiming(
                lease_duration=args.lease_duration,
                renew_deadline=args.renew_deadline,
                retry_period=args.retry_period,
            ),
            lead=self.lead,
            on_failure=self.fail,
            on_change=self.label,
        )

    def lead(self, stop: threading.Event) -> None:
        """Run the leader's kopf operator until ``stop`` (in the election's thread)."""
        namespaces = tuple(self.args.namespace)
        run_until(
            stop,
            registry=self.registry,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            memo=kopf.Memo(),
        )

    def fail(self) -> None:
        self.failed = True
        self.process_stop.set()

    def label(self, leading: bool) -> None:
        """The pod's role label (the reports Service selects the leader); only in a pod."""
        if self.pod is None or self.pod_namespace is None:
            return
        from kubernetes import client

        role = leadership.LEADER if leading else leadership.STANDBY
        leadership.label_own_pod(client.CoreV1Api(), self.pod_namespace, self.pod, role)

    async def start(self, **_: Any) -> None:
        """kopf startup handler: mark the pod standby (a restarted container keeps its labels),
        then campaign."""
        import asyncio

        try:
            await asyncio.to_thread(self.label, False)
        except Exception as exc:  # the label only steers reports
            logging.getLogger("strata.leadership").warning("could not label the pod: %s", exc)
        self.elector.start()

    async def stop(self, **_: Any) -> None:
        """kopf cleanup handler: label the pod standby (the reports Service stops selecting it
        before the Lease's next holder labels itself leader), then stop leading and release the
        Lease."""
        import asyncio

        try:
            await asyncio.to_thread(self.label, False)
        except Exception as exc:  # the label only steers reports
            logging.getLogger("strata.leadership").warning("could not label the pod: %s", exc)
        await asyncio.to_thread(self.elector.stop)

    def register(self, registry: kopf.OperatorRegistry) -> None:
        kopf.on.startup(id="start_leader_election", registry=registry)(self.start)
        kopf.on.cleanup(id="stop_leader_election", registry=registry)(self.stop)


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the operator until SIGINT/SIGTERM; returns the exit code."""
    from kubernetes import config

    extensions = default_extensions()
    args = build_parser(extensions).parse_args(argv)
    if args.kubeconfig:
        use_kubeconfig(args.kubeconfig)
    setup_logging(args.log_format, verbose=args.verbose, debug=args.debug)
    memory.limit_tls_buffers()
    memory.TRIMMER.start()
    memory.install_debug_snapshot()
    config.load_config()  # type: ignore[no-untyped-call]
    wiring = build_wiring(args)
    namespaces = tuple(args.namespace)
    if not args.leader_elect:
        kopf.run(
            registry=build_registry(args, wiring, extensions),
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(),
        )
        return 0
    registry, leader_registry = build_registries(args, wiring, extensions)
    try:
        elected = ElectedOperator(args, leader_registry, threading.Event())
    except ValueError as err:  # lease timings that cannot work together
        raise SystemExit(f"strata operator: {err}") from None
    elected.register(registry)
    run_until(
        elected.process_stop,
        registry=registry,
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(),
    )
    return 1 if elected.failed else 0
