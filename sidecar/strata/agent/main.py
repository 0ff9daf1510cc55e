"""Entry point of ``strata sidecar``: configuration errors exit 2 with a message naming the setting."""

from __future__ import annotations

import logging
import os
import sys

from strata.agent.logs import setup_logging
from strata.config import ConfigError, SidecarConfig
from strata.policies import PolicyError

log = logging.getLogger("strata.sidecar")

EXIT_CONFIG = 2


def run_sidecar(log_level: str = "INFO") -> int:
    """Run the sidecar until SIGTERM; 0 after a clean flush, 1 when it failed, 2 on bad config."""
    setup_logging(log_level)
    # Files and directories the sidecar creates in the shared RAM volume stay group-writable,
    # so a trainer running under another UID of the pod's fsGroup can use them.
    os.umask(0o002)
    try:
        config = SidecarConfig.from_env()
        from strata.agent.service import Sidecar

        sidecar = Sidecar(config)
    except (ConfigError, PolicyError) as exc:
        print(f"strata sidecar: {exc}", file=sys.stderr)
        log.error("invalid configuration: %s", exc, extra={"event": "config_error"})
        return EXIT_CONFIG
    return sidecar.serve()
