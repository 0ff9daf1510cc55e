"""``python -m strata.peers``: the peer service alone (tests, the bench, debugging).

The sidecar runs the same :class:`~strata.peers.service.PeerService` in its background; this entry
point runs it without the rest of the sidecar. Environment: ``STRATA_JOB_ID``, ``STRATA_RAM_DIR``,
``STRATA_PEERS`` (JSON of :class:`~strata.peers.config.PeersConfig`, ``self_id`` required),
optional ``NODE_NAME`` and ``STRATA_FAILURE_DOMAIN``. Logs one JSON line per round result to
stdout. Exit 2 on bad configuration, 0 on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from pydantic import ValidationError

from strata.peers.config import PeersConfig
from strata.peers.service import PeerService
from strata.tiers.ram import RamTier


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        job, ram_dir = os.environ["STRATA_JOB_ID"], os.environ["STRATA_RAM_DIR"]
        config = PeersConfig.model_validate_json(os.environ["STRATA_PEERS"])
    except (KeyError, ValidationError) as exc:
        print(f"strata peers: bad configuration: {exc}", file=sys.stderr)
        return 2
    if config.self_id is None:
        print("strata peers: STRATA_PEERS needs self_id", file=sys.stderr)
        return 2
    svc = PeerService(
        config,
        job,
        RamTier(ram_dir),
        self_id=config.self_id,
        node=os.environ.get("NODE_NAME") or None,
        domain=os.environ.get("STRATA_FAILURE_DOMAIN") or None,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    svc.start()
    listening = {"event": "listening", "port": svc.port, "cpu_seconds": time.process_time()}
    print(json.dumps(listening), flush=True)
    while not stop.is_set():
        try:
            r = svc.run_round()
            print(
                json.dumps(
                    {
                        "event": "round",
                        "copied": r.copied,
                        "encoded": r.encoded,
                        "notes": r.notes,
                        "bytes_in": svc.ingress.total,
                        "bytes_out": svc.egress.total,
                        "cpu_seconds": time.process_time(),
                    }
                ),
                flush=True,
            )
        except Exception as exc:  # keep serving; the next round retries
            print(json.dumps({"event": "round_failed", "error": str(exc)}), flush=True)
        stop.wait(config.poll_seconds)
    svc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
