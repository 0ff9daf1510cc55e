"""``kubectl strata``: the kubectl plugin (krew naming: the executable ``kubectl-strata``).

::

    kubectl strata status [POLICY] [-n NS | -A]      policies, their jobs, newest complete step per
                                                     tier, last restore and from where, unprotected pods
    kubectl strata describe job JOB [-n NS]          one job: its policy, where its data lies, its
                                                     status, its pods
    kubectl strata verify job JOB [-n NS] [--step S] run `strata verify` where the data is: a Job in
                                                     the namespace mounting the policy's PVC (and
                                                     reading its GCS bucket), then its result
    kubectl strata version [--client]                this plugin's version and the operator's in
                                                     the cluster (a minor-version skew is flagged)

Common flags: ``--kubeconfig``, ``--context``, ``-n/--namespace``, ``-A/--all-namespaces``,
``-o table|json|yaml``. Installed with the package (``pip install 'strata-checkpoint[operator]'``: it needs
the Kubernetes client); never imports torch (this package's import contract).

Rule: an entry point beside :mod:`strata_operator.main`: it reads the cluster and the API models
and reuses the admission's pure naming (``job_id_for``); nothing in the operator imports it.

Exit codes: 0 success; 1 ``verify``: a bad copy was found (the verification's own exit code is
passed through: 1 bad copy, 3 nothing found, 4 a tier unreadable); 2 usage error; 3 not found
(no such policy or job); 5 the cluster could not be reached or refused (RBAC); 6 ``verify``: the
verification Job did not finish in ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from strata.errors import StrataError

EXIT_OK, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CLUSTER, EXIT_TIMEOUT = 0, 2, 3, 5, 6

EPILOG = """\
exit codes: 0 success; 1 verify found a bad copy (verify passes `strata verify`'s code through:
1 bad copy, 3 nothing found, 4 a tier unreadable); 2 usage error; 3 no such policy or job;
5 the cluster could not be reached or refused the request; 6 verify timed out
"""


class PluginError(StrataError):
    """A failure with a message for the user and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
    )
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    common.add_argument("-n", "--namespace", help="namespace (default: the context's)")
    common.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    common.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")

    parser = argparse.ArgumentParser(
        prog="kubectl strata",
        description="Strata checkpoints on Kubernetes: status, describe, verify, version",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", parents=[common], help="policies, jobs, steps per tier, restores")
    st.add_argument("policy", nargs="?", help="only this CheckpointPolicy")

    de = sub.add_parser("describe", parents=[common], help="describe a job")
    de.add_argument("kind", choices=("job",))
    de.add_argument("job", help="the Strata job id (<namespace>.<workload> or the run id)")

    ve = sub.add_parser(
        "verify",
        parents=[common],
        help="verify a job's checkpoints where they lie (a Job mounting the PVC)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ve.add_argument("kind", choices=("job",))
    ve.add_argument("job", help="the Strata job id (<namespace>.<workload> or the run id)")
    ve.add_argument("--step", type=int, help="only this step (default: every step)")
    ve.add_argument("--policy", help="the job's CheckpointPolicy (default: the one reporting it)")
    ve.add_argument("--image", help="image with `strata` (default: the policy's sidecar image)")
    ve.add_argument("--service-account", help="service account of the Job (GCS credentials)")
    ve.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    ve.add_argument("--no-wait", action="store_true", help="create the Job and print its name")

    vn = sub.add_parser(
        "version", parents=[common], help="this plugin's and the operator's version"
    )
    vn.add_argument("--client", action="store_true", help="only this plugin's (no cluster)")
    return parser


def print_doc(doc: Any, fmt: str) -> None:
    if fmt == "yaml":
        import yaml

        print(yaml.safe_dump(doc, sort_keys=False), end="")
    else:
        print(json.dumps(doc, indent=2, default=str))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from strata_operator.kubectl.cluster import Cluster

    if args.command == "version" and args.client:
        from strata_operator.kubectl.version import client_doc, print_version

        print_version(client_doc(), args.output)
        return EXIT_OK
    try:
        cluster = Cluster.connect(args.kubeconfig, args.context)
        with cluster:
            if args.command == "status":
                from strata_operator.kubectl.status import status

                return status(cluster, args)
            if args.command == "describe":
                from strata_operator.kubectl.status import describe

                return describe(cluster, args)
            if args.command == "version":
                from strata_operator.kubectl.version import version

                return version(cluster, args)
            from strata_operator.kubectl.verify import verify

            return verify(cluster, args)
    except PluginError as exc:
        print(f"kubectl strata {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except ApiException as exc:
        reason = exc.reason or ""
        what = "forbidden (check your RBAC)" if exc.status == 403 else reason
        print(
            f"kubectl strata {args.command}: the cluster refused: {exc.status} {what}: "
            f"{(exc.body or '')[:500]}",
            file=sys.stderr,
        )
        return EXIT_CLUSTER
    except (HTTPError, OSError) as exc:
        print(f"kubectl strata {args.command}: cannot reach the cluster: {exc}", file=sys.stderr)
        return EXIT_CLUSTER
