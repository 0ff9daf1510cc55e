"""Fault-injection points: named places in the save, commit, promotion and staging paths where
the fault-injection suite (``tests/chaos``) stops or kills a real process.

``STRATA_FAULT`` holds comma-separated rules ``<point>[#<n>][=<action>]``: at the ``n``-th time
(1-based, default 1) this process reaches ``point``, do ``action``:

- ``kill`` (default): SIGKILL this process (a crash at exactly that point);
- ``stop``: SIGSTOP this process (a test resumes it with SIGCONT after arranging a race);
- ``eio``: raise ``OSError(EIO)`` (a failed write).

Unset (production), :func:`point` is one dictionary lookup. The points (:data:`POINTS`) are
listed so a campaign can pick among them; an unknown name in ``STRATA_FAULT`` is an error at
the first check, not a silently dead rule.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

ENV_FAULT = "STRATA_FAULT"

POINTS = (
    "save.copied",  # the state is in the slot, nothing linked yet
    "save.confirm",  # storages were left in place in the slot; their confirmation has not run
    "commit.linked",  # the slot is linked as the step's data, no manifest yet
    "commit.done",  # the manifest is written, save() has not returned
    "seal.before",  # the checksum pass computed CRCs, the manifest is not rewritten yet
    "posix.data_written",  # a PVC copy's data is durable, its manifest not yet written
    "gcs.data_uploaded",  # a GCS copy's data object is stored, its manifest not yet uploaded
    "stage.copied",  # a restore copied a shard into a RAM slot, not yet committed there
    "promotion.round",  # the sidecar starts a promotion round
)

_counts: dict[str, int] = {}
_lock = threading.Lock()
_parsed: tuple[str, dict[str, tuple[int, str]]] | None = None


def _rules() -> dict[str, tuple[int, str]]:
    global _parsed
    raw = os.environ.get(ENV_FAULT, "")
    if _parsed is not None and _parsed[0] == raw:
        return _parsed[1]
    rules: dict[str, tuple[int, str]] = {}
    for item in filter(None, (r.strip() for r in raw.split(","))):
        name, _, action = item.partition("=")
        name, _, nth = name.partition("#")
        if name not in POINTS or (action or "kill") not in ("kill", "stop", "eio"):
            raise ValueError(
                f"{ENV_FAULT}: bad rule {item!r}; points are {', '.join(POINTS)}, actions "
                "kill, stop, eio"
            )
        rules[name] = (int(nth or 1), action or "kill")
    _parsed = (raw, rules)
    return rules


def point(name: str) -> None:
    """A fault-injection point (see the module docstring); does nothing unless configured."""
    if ENV_FAULT not in os.environ:
        return
    rule = _rules().get(name)
    if rule is None:
        return
    with _lock:
        _counts[name] = n = _counts.get(name, 0) + 1
    if n != rule[0]:
        return
    if rule[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif rule[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise OSError(errno.EIO, f"injected fault at {name}")
