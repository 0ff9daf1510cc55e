"""The operator logs JSON lines like the sidecar's (kopf's per-object lines carry the object);
``--log-format text`` / STRATA_OPERATOR_LOG_FORMAT=text keeps kopf's plain lines."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import cast

import kopf
import pytest

from strata_operator import main
from strata_operator.logs import ENV_LOG_FORMAT, setup_logging

pytestmark = pytest.mark.unit

POLICY = {
    "apiVersion": "strata.dev/v1alpha1",
    "kind": "CheckpointPolicy",
    "metadata": {"namespace": "team-a", "name": "demo", "uid": "u-1"},
}


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _object_logger() -> logging.LoggerAdapter[logging.Logger]:
    return kopf.ObjectLogger(
        body=kopf.Body(cast(kopf.RawBody, POLICY)), settings=kopf.OperatorSettings()
    )


def test_json_lines_have_the_sidecars_fields_and_the_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("json")
    _object_logger().info("Handler 'reconcile' succeeded.")
    logging.getLogger("strata.operator").warning("policy not ready", extra={"event": "not_ready"})
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 2, lines
    kopf_line, own = lines
    assert set(kopf_line) >= {"time", "severity", "logger", "message", "object"}
    assert kopf_line["severity"] == "INFO" and kopf_line["time"].endswith("+00:00")
    assert kopf_line["message"] == "Handler 'reconcile' succeeded."
    assert kopf_line["object"]["namespace"] == "team-a" and kopf_line["object"]["name"] == "demo"
    assert "settings" not in kopf_line and "k8s_skip" not in kopf_line
    assert own["event"] == "not_ready" and own["logger"] == "strata.operator"
    assert own["severity"] == "WARNING" and "object" not in own


def test_text_format_keeps_kopfs_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("text")
    _object_logger().info("Handler 'reconcile' succeeded.")
    err = capsys.readouterr().err
    assert "Handler 'reconcile' succeeded." in err
    with pytest.raises(json.JSONDecodeError):
        json.loads(err.splitlines()[-1])


def test_the_flag_defaults_to_json_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_LOG_FORMAT, raising=False)
    assert main.build_parser().parse_args([]).log_format == "json"
    monkeypatch.setenv(ENV_LOG_FORMAT, "text")
    assert main.build_parser().parse_args([]).log_format == "text"
    assert main.build_parser().parse_args(["--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        main.build_parser().parse_args(["--log-format", "xml"])
