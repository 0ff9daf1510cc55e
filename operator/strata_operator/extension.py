"""The contract between the operator's command line (:mod:`strata_operator.main`) and its roles.

Rule: a role (reconcile, admission, reports) joins the operator as an :class:`Extension` object
that :func:`strata_operator.main.run` lists explicitly: it declares its flags, is configured
once from the parsed flags and the :class:`Wiring` that ``main`` built for every role, and
registers its kopf handlers into the registry it is given. Importing a module registers nothing.

Call order (``main.run``): ``add_arguments`` of every extension; parse; load the kubeconfig;
build the :class:`Wiring`; then, per extension in list order, ``configure`` and ``register``;
then ``kopf.run`` with that registry. An extension never reads another extension's state: what
two roles share (the TLS files, where sidecars send reports) is in the :class:`Wiring`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Protocol

import kopf

from strata_operator.certs import TlsFiles


@dataclass(frozen=True)
class ReportEndpoint:
    """Where the injected sidecars send their reports (the report receiver's public address)."""

    url: str
    """Base URL, ``https://host:port`` (the report path is appended by the sidecar)."""
    audience: str
    """Audience of the projected service-account token the sidecar presents."""


@dataclass(frozen=True)
class Wiring:
    """What ``main`` builds once for every extension, before any is configured."""

    tls: TlsFiles
    """Certificate, key and CA of the operator's HTTPS servers (webhook and report receiver)."""
    report: ReportEndpoint | None
    """The report receiver's address; None when the receiver is off (``--report-port 0``)."""


class Extension(Protocol):
    """One role of the operator, joined explicitly by ``main`` (see the module docstring)."""

    name: str
    """Short name for logs and errors (``reconcile``, ``webhook``, ``reports``)."""
    leader_only: bool
    """With ``--leader-elect``: whether the role runs only on the replica holding the Lease
    (it writes policies: reconcile, reports) or on every replica (admission);
    :mod:`strata_operator.leadership`."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add this role's flags (an argument group of its own)."""

    def configure(self, args: argparse.Namespace, wiring: Wiring) -> None:
        """Build the role's state (options, Kubernetes clients) from the flags; no handler runs
        yet. Errors: ``SystemExit`` with a message for flags that cannot work together."""

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Register the role's kopf handlers into ``registry`` (called after :meth:`configure`)."""
