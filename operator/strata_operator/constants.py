"""Every name the operator writes into or reads from the cluster, in one place.

Labels, annotations, condition types and reasons, Event reasons, the names of what the webhook
injects (container, volumes, mounts, env, port), kopf's storage keys. Rule of this module: plain
constants only (no logic; the only import of ours is :mod:`strata.constants`, the names the data
plane reads too, which are taken from there rather than written twice), so that every other
layer may import it.
A name here is part of the API users see (``kubectl describe``, their pod specs): changing one is
a breaking change.
"""

from __future__ import annotations

from typing import Final

from strata import constants as shared

# --- labels and annotations -------------------------------------------------------------------

DOMAIN: Final = "strata.dev"
POLICY_LABEL: Final = "strata.dev/policy"
"""Pod label (and workload annotation) naming the CheckpointPolicy in the pod's namespace."""
RUN_ID_ANNOTATION: Final = shared.RUN_ID_ANNOTATION
"""Overrides the job id so that a resubmitted run continues from its checkpoints."""
INJECTED_ANNOTATION: Final = "strata.dev/injected"
"""Marker set on injected pods; value: the policy name."""
REPORT_CA_ANNOTATION: Final = "strata.dev/report-ca"
"""PEM bundle of the report endpoint's CA, projected into the token volume as ``ca.crt``."""
OWNED_ANNOTATIONS: Final = (INJECTED_ANNOTATION, REPORT_CA_ANNOTATION)
"""Annotations only the webhook writes; a pod that brings its own is refused."""
MANAGED_BY: Final = {"app.kubernetes.io/managed-by": "strata-operator"}

JOBSET_NAME_LABEL: Final = "jobset.sigs.k8s.io/jobset-name"
PYTORCHJOB_NAME_LABEL: Final = "training.kubeflow.org/job-name"
JOB_NAME_LABELS: Final = ("batch.kubernetes.io/job-name", "job-name")
PSS_ENFORCE_LABEL: Final = "pod-security.kubernetes.io/enforce"
"""Namespaces enforcing ``baseline`` or ``restricted`` refuse hostPath volumes
(https://kubernetes.io/docs/concepts/security/pod-security-standards/)."""

# --- what the webhook injects -----------------------------------------------------------------

SIDECAR_NAME: Final = "strata-sidecar"
RAM_VOLUME: Final = "strata-ram"
PVC_VOLUME: Final = "strata-pvc"
TOKEN_VOLUME: Final = "strata-token"
TMP_VOLUME: Final = "strata-tmp"
"""The sidecar's writable ``/tmp`` (an emptyDir): its root filesystem is read-only."""
TMP_SIZE: Final = "64Mi"
PEERS_TLS_VOLUME: Final = "strata-peers-tls"
"""Secret volume of the job's peer certificate; mounted into the sidecar container only."""
VOLUMES: Final = (RAM_VOLUME, PVC_VOLUME, TOKEN_VOLUME, TMP_VOLUME, PEERS_TLS_VOLUME)
"""Volume names Strata reserves: a pod that already has one is refused."""
TOKEN_DIR: Final = "/var/run/secrets/strata.dev"
TOKEN_FILE: Final = "token"
CA_FILE: Final = "ca.crt"
METRICS_PORT_NAME: Final = "strata-metrics"
CONFIG_ENV: Final = shared.ENV_CONFIG
"""The sidecar contract's env var: the whole :class:`strata.config.StrataConfig` as JSON."""
STRATA_ENV_PREFIX: Final = "STRATA_"
"""Env vars with this prefix belong to Strata; a container that sets one is refused."""

RANK_LABELS: Final[tuple[tuple[str, str], ...]] = (
    ("STRATA_JOBSET_JOB_INDEX", "jobset.sigs.k8s.io/job-index"),
    ("STRATA_JOBSET_JOB_GLOBAL_INDEX", "jobset.sigs.k8s.io/job-global-index"),
    ("STRATA_JOBSET_REPLICATED_JOB", "jobset.sigs.k8s.io/replicatedjob-name"),
    ("STRATA_COMPLETION_INDEX", "batch.kubernetes.io/job-completion-index"),
    ("STRATA_REPLICA_TYPE", "training.kubeflow.org/replica-type"),
    ("STRATA_REPLICA_INDEX", "training.kubeflow.org/replica-index"),
)
"""(env var, pod label) pairs wired through the downward API when the label is present."""
POD_FIELD_ENV: Final[tuple[tuple[str, str], ...]] = (
    (shared.ENV_POD_NAME, "metadata.name"),
    (shared.ENV_POD_NAMESPACE, "metadata.namespace"),
    (shared.ENV_POD_UID, "metadata.uid"),
    (shared.ENV_NODE_NAME, "spec.nodeName"),
)
"""(env var, downward-API field) pairs; a container may already set the same var to the same
field (kept), not to anything else (refused)."""

# --- admission --------------------------------------------------------------------------------

POD_WEBHOOK: Final = "inject-pods"
DENIAL_PREFIX: Final = "Strata: "
"""Every admission denial starts with this, so a user sees who refused the pod."""
MAX_ANNOTATIONS_BYTES: Final = 256 * 1024
"""Kubernetes' limit on the total size of an object's annotation keys and values
(apimachinery ``TotalAnnotationSizeLimitB``)."""

# --- condition types and reasons (status.conditions; also the Events of a Ready change) -------

READY: Final = "Ready"
"""The policy is valid and every configured tier is usable: workloads may name it."""
DEGRADED: Final = "Degraded"
"""The policy works but something reduces protection (e.g. a PVC that is not ReadWriteMany)."""
FLUSH_FITS: Final = "FlushFitsGracePeriod"
"""A termination flush of every reported job's state fits in its pods' grace period (set by the
report receiver from the sidecars' flush estimates; absent until one was measured)."""

REASON_RECONCILED: Final = "Reconciled"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_PVC_NOT_FOUND: Final = "PvcNotFound"
REASON_PVC_LOST: Final = "PvcLost"
REASON_SECRET_NOT_FOUND: Final = "SecretNotFound"
REASON_BUCKET_NOT_FOUND: Final = "BucketNotFound"
REASON_BUCKET_FORBIDDEN: Final = "BucketForbidden"
REASON_BUCKET_UNREACHABLE: Final = "BucketUnreachable"
REASON_HOST_PATH_FORBIDDEN: Final = "HostPathForbidden"
REASON_API_ERROR: Final = "ApiError"

REASON_AS_EXPECTED: Final = "AsExpected"
REASON_PVC_NOT_SHARED: Final = "PvcNotShared"
REASON_PVC_PENDING: Final = "PvcPending"
REASON_BUCKET_NOT_CHECKED: Final = "BucketNotChecked"
REASON_NOT_EVALUATED: Final = "NotEvaluated"
REASON_FLUSH_FITS: Final = "FlushFits"
REASON_FLUSH_TOO_SLOW: Final = "FlushTooSlow"
"""The measured flush of the current state needs longer than the grace period allows."""
REASON_FLUSH_MISSED: Final = "FlushMissedDeadline"
"""A pod's termination flush did not finish before its deadline (or failed)."""

CONDITION_REASONS: Final = frozenset(
    {
        REASON_RECONCILED,
        REASON_INVALID_SPEC,
        REASON_PVC_NOT_FOUND,
        REASON_PVC_LOST,
        REASON_SECRET_NOT_FOUND,
        REASON_BUCKET_NOT_FOUND,
        REASON_BUCKET_FORBIDDEN,
        REASON_BUCKET_UNREACHABLE,
        REASON_HOST_PATH_FORBIDDEN,
        REASON_API_ERROR,
        REASON_AS_EXPECTED,
        REASON_PVC_NOT_SHARED,
        REASON_PVC_PENDING,
        REASON_BUCKET_NOT_CHECKED,
        REASON_NOT_EVALUATED,
        REASON_FLUSH_FITS,
        REASON_FLUSH_TOO_SLOW,
        REASON_FLUSH_MISSED,
    }
)

# --- Event reasons of the report receiver -----------------------------------------------------

EVENT_RESTORED: Final = "Restored"
EVENT_FRESH_START: Final = "FreshStart"
EVENT_RESTORE_FAILED: Final = "RestoreFailed"
EVENT_TIER_FAILED: Final = "TierFailed"
EVENT_TIER_TOO_SMALL: Final = "TierTooSmall"
EVENT_NOT_PROTECTED: Final = "NotProtected"
EVENT_FLUSH_TOO_SLOW: Final = "FlushTooSlow"
"""Warning: a job's termination flush cannot fit in its pods' grace period."""
EVENT_FLUSH_MISSED: Final = "FlushMissedDeadline"
"""Warning: a pod's termination flush missed its deadline or failed."""

# --- kopf storage and API identity ------------------------------------------------------------

PERSISTENCE_PREFIX: Final = "strata.dev"
FINALIZER: Final = "strata.dev/finalizer"
"""Configured so kopf never uses its own name; no handler makes kopf add it (C-13)."""
FIELD_MANAGER: Final = "strata-operator"
COMPONENT: Final = "strata-operator"
"""``reportingController`` of the Events the operator posts (``kubectl describe``'s "From")."""
ACTION_RECONCILE: Final = "Reconcile"
"""``action`` of the reconcile's Events (a Ready change)."""
ACTION_FOLD_REPORT: Final = "FoldReport"
"""``action`` of the report receiver's Events (restores, tier failures, flush estimates)."""
ACTION_CHECK_POD: Final = "CheckPod"
"""``action`` of the Events about a labelled pod that runs without the sidecar."""

# --- peer tier (docs/peers.md) ------------------------------------------------------

PEERS_PORT_NAME: Final = "strata-peers"
ZONE_LABEL: Final = "topology.kubernetes.io/zone"
"""Pod label (PodTopologyLabels, Kubernetes 1.33+) the sidecar's failure domain comes from."""
