"""``kubectl strata version``: this plugin's version and the operator's in the cluster.

The operator is found by its labels (the chart's and ``manifests/strata.yaml``'s:
``app.kubernetes.io/part-of=strata``, ``app.kubernetes.io/component=operator``) in every
namespace; its version is the ``app.kubernetes.io/version`` label (the chart's appVersion), its
image is the Deployment's first container's. A major or minor version other than the plugin's is
flagged (README "Versions and skew": the operator and the sidecars it injects must be of the same
minor version as the trainers' package). ``--client``: the plugin's version only, no cluster.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from typing import Any

DISTRIBUTION = "strata-checkpoint"


def _installed_version() -> str:
    # Not `strata.__version__`: importing the strata package is an import of its training client
    # to the import contracts (and the operator never imports torch). Same number (one version).
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


__version__ = _installed_version()

OPERATOR_SELECTOR = "app.kubernetes.io/part-of=strata,app.kubernetes.io/component=operator"
VERSION_LABEL = "app.kubernetes.io/version"


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.lstrip("v").split(".")[:2])


def client_doc() -> dict[str, Any]:
    return {"client": {"version": __version__, "python": sys.version.split()[0]}}


def operators(cluster: Any) -> list[dict[str, Any]]:
    """The Strata operator Deployments of the cluster: namespace, name, version, image, ready."""
    from kubernetes import client

    apps = client.AppsV1Api(cluster.api_client)
    found: Any = apps.list_deployment_for_all_namespaces(label_selector=OPERATOR_SELECTOR)
    items: list[Any] = list(found.items)
    out = []
    for d in sorted(items, key=lambda d: (d.metadata.namespace, d.metadata.name)):
        containers = d.spec.template.spec.containers or []
        version = (d.metadata.labels or {}).get(VERSION_LABEL)
        out.append(
            {
                "namespace": d.metadata.namespace,
                "name": d.metadata.name,
                "version": version,
                "image": containers[0].image if containers else None,
                "ready": f"{(d.status.ready_replicas or 0)}/{d.spec.replicas or 0}",
                "skew": version is not None and _minor(version) != _minor(__version__),
            }
        )
    return out


def print_version(doc: dict[str, Any], fmt: str) -> None:
    from strata_operator.kubectl import print_doc

    if fmt != "table":
        print_doc(doc, fmt)
        return
    print(f"kubectl-strata {doc['client']['version']} (python {doc['client']['python']})")
    if "operators" not in doc:
        return
    if not doc["operators"]:
        print("operator: none found (no Deployment labelled " + OPERATOR_SELECTOR + ")")
    for op in doc["operators"]:
        print(
            f"operator {op['namespace']}/{op['name']}: {op['version'] or 'unknown'} "
            f"(image {op['image']}, ready {op['ready']})"
        )
        if op["skew"]:
            print(
                f"  warning: the operator's version {op['version']} differs from this plugin's "
                f"{doc['client']['version']} in its major or minor number; see README "
                "'Versions and skew'"
            )


def version(cluster: Any, args: argparse.Namespace) -> int:
    from strata_operator.kubectl import EXIT_OK

    doc = client_doc()
    doc["operators"] = operators(cluster)
    print_version(doc, args.output)
    return EXIT_OK
