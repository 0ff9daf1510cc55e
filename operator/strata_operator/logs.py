"""The operator's logs: JSON lines on stderr like the sidecar's (:mod:`strata.sidecar.logs`), or
kopf's plain text.

JSON fields: ``time`` (RFC 3339, UTC), ``severity``, ``logger``, ``message``, any ``extra={...}``
keys of the call site, ``object`` (``apiVersion``, ``kind``, ``namespace``, ``name``, ``uid``) for
kopf's per-object log lines, and ``exception`` with the traceback. Chosen by ``--log-format``
(default: ``STRATA_OPERATOR_LOG_FORMAT``, else ``json``).
"""

from __future__ import annotations

import copy
import logging
from typing import Literal

import kopf

from strata.sidecar.logs import JsonFormatter

LogFormat = Literal["json", "text"]
ENV_LOG_FORMAT = "STRATA_OPERATOR_LOG_FORMAT"
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "text")
_KOPF_ONLY = ("k8s_ref", "k8s_skip", "settings")
"""Record attributes kopf's ObjectLogger adds: the reference becomes ``object``, the rest goes."""


class OperatorJsonFormatter(JsonFormatter):
    """The sidecar's JSON line, with kopf's object reference as ``object``."""

    def format(self, record: logging.LogRecord) -> str:
        if not any(hasattr(record, k) for k in _KOPF_ONLY):
            return super().format(record)
        record = copy.copy(record)
        ref = record.__dict__.pop("k8s_ref", None)
        for key in _KOPF_ONLY:
            record.__dict__.pop(key, None)
        if ref:
            record.object = dict(ref)
        return super().format(record)


def setup_logging(log_format: LogFormat, *, verbose: bool = False, debug: bool = False) -> None:
    """kopf's logging configuration (levels, its stderr handler) with ``log_format`` lines."""
    kopf.configure(verbose=verbose, debug=debug)
    if log_format == "text":
        return
    for handler in logging.getLogger().handlers:
        if type(handler).__module__.startswith("kopf."):
            handler.setFormatter(OperatorJsonFormatter())
