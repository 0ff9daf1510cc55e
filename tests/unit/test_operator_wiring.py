"""How the operator's roles join it: explicit Extension objects, one registry, shared wiring.

No cluster: the Kubernetes client objects are built but never called; the TLS files are real.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

import kopf
import pytest

import strata_operator
from strata_operator import main
from strata_operator.admission.webhook import Webhook
from strata_operator.extension import Extension

pytestmark = pytest.mark.unit


def _ids(handlers: object) -> set[str]:
    return {str(h.id) for h in handlers}  # type: ignore[attr-defined]


def _all_ids(registry: kopf.OperatorRegistry) -> dict[str, set[str]]:
    return {
        "activities": _ids(registry._activities.get_all_handlers()),
        "watching": _ids(registry._watching.get_all_handlers()),
        "changing": _ids(registry._changing.get_all_handlers()),
        "webhooks": _ids(registry._webhooks.get_all_handlers()),
    }


def test_importing_the_operator_registers_no_handler() -> None:
    for info in pkgutil.walk_packages(strata_operator.__path__, "strata_operator."):
        if info.name.endswith("__main__"):
            continue  # running it is the point of a __main__
        importlib.import_module(info.name)
    registered = _all_ids(kopf.get_default_registry())
    ours = {
        kind: {i for i in ids if not i.startswith("login_via_")} for kind, ids in registered.items()
    }
    assert ours == {"activities": set(), "watching": set(), "changing": set(), "webhooks": set()}


def _args(tmp_path: Path, *extra: str) -> tuple[argparse.Namespace, list[Extension]]:
    extensions = main.default_extensions()
    argv = ["--tls-workdir", str(tmp_path), "--metrics-port", "0", *extra]
    return main.build_parser(extensions).parse_args(argv), extensions


def test_every_role_registers_its_handlers_into_the_one_registry(tmp_path: Path) -> None:
    args, extensions = _args(tmp_path)
    registry = main.build_registry(args, main.build_wiring(args), extensions)
    assert _all_ids(registry) == {
        "activities": {
            "login_via_client",
            "tune_kopf",
            "start_webhook_server",
            "start_receiver",
            "stop_receiver",
        },
        "watching": {"pvc_changed", "policy_event", "labelled_pod"},
        "changing": {"reconcile_policy"},
        "webhooks": {"inject-pods", "label-jobs", "label-jobsets", "label-pytorchjobs"},
    }
    args, extensions = _args(tmp_path / "s", "--watch-secrets")
    registry = main.build_registry(args, main.build_wiring(args), extensions)
    assert "secret_changed" in _all_ids(registry)["watching"]


def test_the_webhook_injects_the_report_endpoint_that_main_wired(tmp_path: Path) -> None:
    args, extensions = _args(tmp_path, "--webhook-host", "10.0.0.7", "--report-port", "8500")
    wiring = main.build_wiring(args)
    main.build_registry(args, wiring, extensions)
    webhook = next(e for e in extensions if isinstance(e, Webhook))
    assert webhook.state is not None
    assert webhook.state.injection.report_endpoint == "https://10.0.0.7:8500"
    assert webhook.state.injection.report_ca_pem == wiring.tls.ca_pem
    assert webhook.state.tls == wiring.tls

    args, extensions = _args(tmp_path / "off", "--report-port", "0")
    wiring = main.build_wiring(args)
    assert wiring.report is None
    main.build_registry(args, wiring, extensions)
    webhook = next(e for e in extensions if isinstance(e, Webhook))
    assert webhook.state is not None and webhook.state.injection.report_endpoint is None
