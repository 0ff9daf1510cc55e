"""Names the data plane and the operator must agree on: environment variables, file names,
HTTP paths, annotation keys. The operator's webhook writes them, the sidecar and the client read
them; both import them from here so that a rename cannot split them.

Rule: constants only (no imports from the rest of Strata).
"""

from __future__ import annotations

# -- environment of the trainer and the sidecar (set by the webhook; see strata.config) ---------

ENV_CONFIG = "STRATA_CONFIG"
"""JSON of the whole :class:`strata.config.StrataConfig` (what the webhook injects)."""
ENV_JOB_ID = "STRATA_JOB_ID"
ENV_SOCKET = "STRATA_SOCKET"
ENV_RAM_DIR = "STRATA_RAM_DIR"
ENV_PVC_DIR = "STRATA_PVC_DIR"
ENV_GCS_BUCKET = "STRATA_GCS_BUCKET"
ENV_GCS_PREFIX = "STRATA_GCS_PREFIX"
ENV_TERMINATION_GRACE = "STRATA_TERMINATION_GRACE_SECONDS"
"""The pod's terminationGracePeriodSeconds (overrides ``termination_grace_seconds`` of
``STRATA_CONFIG``): the budget of the termination flush, for the trainer and the sidecar."""
ENV_RESTORE_RESHARD = "STRATA_RESTORE_RESHARD"
"""0/false: Checkpointer(reshard=False) (never restore a step of another world size); 1/true:
reshard=True (reshard, per-rank values by the documented rule; the opt-in of earlier versions).
Unset: reshard when the saved state allows it (strata.restore.reshard)."""
ENV_RESTORE_RESHARD_PER_RANK = "STRATA_RESTORE_RESHARD_PER_RANK"
"""1/true: Checkpointer(reshard_per_rank=True) (a resharding restore takes per-rank values by
the documented rule instead of refusing; strata.restore.reshard.PER_RANK_RULE)."""
ENV_ALLOW_DISK_RAM_DIR = "STRATA_ALLOW_DISK_RAM_DIR"
"""1/true: accept the default RAM directory on a disk outside Kubernetes (a warning, not an
error; strata.tiers.medium)."""
ENV_POD_NAME = "POD_NAME"
"""Downward API (``metadata.name``), like the three below."""
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_POD_UID = "POD_UID"
ENV_NODE_NAME = "NODE_NAME"
ENV_FAILURE_DOMAIN = "STRATA_FAILURE_DOMAIN"
"""The pod's failure domain (the webhook maps the topology.kubernetes.io/zone label to it where the
cluster copies node topology labels to pods); the peer tier places copies outside it."""

# -- files ------------------------------------------------------------------------------------------

SOCKET_RELPATH = ".strata/sidecar.sock"
"""The sidecar's local API socket, relative to the RAM tier's directory (the default of
``StrataConfig.socket``)."""
HEARTBEAT_NAME = ".strata-heartbeat"
"""``<ram>/<job>/.strata-heartbeat``: touched by a live sidecar; the hostPath janitor removes a
job's RAM data only when it is stale."""

# -- HTTP and Kubernetes ------------------------------------------------------------------------------

REPORT_PATH = "/v1/reports"
"""Where the operator receives sidecar reports (:class:`strata.reports.SidecarReport`)."""
RUN_ID_ANNOTATION = "strata.dev/run-id"
"""Workload annotation overriding the job id, so that a resubmitted run continues from its
checkpoints."""
