"""The ``CheckpointPolicy`` API (``strata.dev/v1alpha1``): pydantic models, the single source of truth.

``crdgen`` turns these models into ``crds/checkpointpolicies.strata.dev.yaml``; the operator parses
stored objects with them; :mod:`strata_operator.sidecar_config` maps a parsed spec to the
sidecar contract. The Kubernetes JSON uses camelCase (``sizeLimit``); Python uses
snake_case (``size_limit``); both are accepted on input (``populate_by_name``).

Value rules live in :mod:`strata_operator.api.validation`. Every cross-field rule exists twice, with
the same message: as a CEL ``x-kubernetes-validations`` rule that the apiserver enforces on
create/update, and as a pydantic validator that the operator applies to what is stored (objects
written before a stricter CRD, or with validation bypassed). The messages say what to fix.
:data:`RULES` holds both halves side by side.

Example::

    apiVersion: strata.dev/v1alpha1
    kind: CheckpointPolicy
    metadata: {name: llm, namespace: training}
    spec:
      tiers:
        ram: {sizeLimit: 16Gi, keep: 1, every: {steps: 10}}
        pvc: {claimName: ckpt-rwx, every: {steps: 100}, keep: 2}
        gcs: {bucket: my-ckpts, prefix: llm, every: {steps: 1000, duration: 1h}, keep: 3}
      restore: {order: [ram, pvc, gcs]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from strata.config import TIER_ORDER, SourceName, TierName
from strata_operator.api.validation import (
    EXTENDED_NEEDS_LIMIT_MESSAGE,
    EXTENDED_NEEDS_LIMIT_RULE,
    REQUEST_ABOVE_LIMIT_MESSAGE,
    REQUEST_NOT_ABOVE_LIMIT_RULE,
    BucketName,
    Duration,
    GcsEndpoint,
    GcsPrefix,
    HostPath,
    ImageReference,
    ObjectName,
    RelativePath,
    ResourceList,
    SizeLimit,
    check_requirements,
    parse_duration,
)

ComponentName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")
]
"""A top-level key of the saved state dict (e.g. ``model``, ``ema``)."""

GROUP: Final = "strata.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "CheckpointPolicy"
PLURAL: Final = "checkpointpolicies"
SINGULAR: Final = "checkpointpolicy"
SHORT_NAMES: Final = ("ckpol",)
CATEGORIES: Final = ("strata",)
API_VERSION: Final = f"{GROUP}/{VERSION}"

DEFAULT_SIDECAR_IMAGE: Final = "ghcr.io/strata-dev/strata:0.1.0"
DEFAULT_HOST_PATH: Final = "/dev/shm/strata"
DEFAULT_METRICS_PORT: Final = 9464
DEFAULT_PEER_PORT: Final = 8477
MAX_PEER_BANDWIDTH: Final = 50 * 10**9
"""Upper bound of ``peers.bandwidth``: 50 GB/s (400 Gb/s, the fastest NICs in use); a larger
value is a typo, not a bound."""
MAX_JOBS: Final = 32
"""Bound of ``status.jobs``; the oldest-updated job is dropped first (keeps the object small)."""
MAX_CONDITIONS: Final = 8

# --- cross-field rules ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: the CEL half (apiserver) and the message (shared with pydantic)."""

    rule: str
    message: str
    field_path: str | None = None

    def cel(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


RULE_HOST_PATH_MEDIUM = Rule(
    "!has(self.hostPath) || self.medium == 'HostPath'",
    "ram.hostPath is only allowed with medium HostPath; remove hostPath or set medium: HostPath",
    ".hostPath",
)
RULE_EVERY_NOT_EMPTY = Rule(
    "has(self.steps) || has(self.duration)",
    "every needs steps and/or duration (e.g. {steps: 100} or {duration: 15m})",
)
RULE_PVC_STEPS_MULTIPLE = Rule(
    "!has(self.pvc) || !has(self.pvc.every) || !has(self.pvc.every.steps) || "
    "!has(self.ram.every) || !has(self.ram.every.steps) || "
    "self.pvc.every.steps % self.ram.every.steps == 0",
    "pvc.every.steps must be a multiple of ram.every.steps (the PVC promotes RAM checkpoints, "
    "so it cannot be more frequent than the RAM tier)",
    ".pvc.every.steps",
)
RULE_GCS_STEPS_MULTIPLE = Rule(
    "!has(self.gcs) || !has(self.gcs.every) || !has(self.gcs.every.steps) || "
    "!has(self.ram.every) || !has(self.ram.every.steps) || "
    "self.gcs.every.steps % self.ram.every.steps == 0",
    "gcs.every.steps must be a multiple of ram.every.steps (GCS promotes RAM checkpoints, "
    "so it cannot be more frequent than the RAM tier)",
    ".gcs.every.steps",
)
RULE_GCS_STEPS_NOT_SHORTER = Rule(
    "!has(self.gcs) || !has(self.pvc) || !has(self.gcs.every) || !has(self.pvc.every) || "
    "!has(self.gcs.every.steps) || !has(self.pvc.every.steps) || "
    "self.gcs.every.steps >= self.pvc.every.steps",
    "gcs.every.steps must not be shorter than pvc.every.steps (the slower, farther tier "
    "is promoted less often)",
    ".gcs.every.steps",
)
RULE_GCS_DURATION_NOT_SHORTER = Rule(
    "!has(self.gcs) || !has(self.pvc) || !has(self.gcs.every) || !has(self.pvc.every) || "
    "!has(self.gcs.every.duration) || !has(self.pvc.every.duration) || "
    "duration(self.gcs.every.duration) >= duration(self.pvc.every.duration)",
    "gcs.every.duration must not be shorter than pvc.every.duration (the slower, farther "
    "tier is promoted less often)",
    ".gcs.every.duration",
)
RULE_ORDER_CONFIGURED = Rule(
    "!has(self.restore) || !has(self.restore.order) || self.restore.order.all(t, "
    "t == 'ram' || (t == 'pvc' && has(self.tiers.pvc)) || (t == 'gcs' && has(self.tiers.gcs)))",
    "restore.order may only name configured tiers; add the tier under spec.tiers or remove "
    "it from restore.order",
    ".restore.order",
)
RULE_ORDER_UNIQUE = Rule(
    "self.all(t, self.exists_one(u, u == t))",
    "restore.order must not repeat a tier",
)
RULE_ARCHIVE_NOT_FIRST = Rule(
    "!has(self.restore) || !has(self.restore.order) || size(self.restore.order) == 0 || "
    "!((self.restore.order[0] == 'pvc' && has(self.tiers.pvc) && has(self.tiers.pvc.components))"
    " || (self.restore.order[0] == 'gcs' && has(self.tiers.gcs) && "
    "has(self.tiers.gcs.components)))",
    "restore.order must not start with an archive tier (one with 'components': it keeps only "
    "part of the state and never resumes training); put a tier that keeps everything first",
    ".restore.order",
)
RULE_COMPONENTS_UNIQUE = Rule(
    "self.all(c, self.exists_one(d, d == c))",
    "components must not repeat a name",
)
COMPONENT_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
RULE_COMPONENT_KEYS = Rule(
    f"self.all(k, size(k) <= 128 && k.matches('{COMPONENT_PATTERN}'))",
    "componentEvery keys must be top-level state names (letters, digits, '_', '.', '-'; at "
    "most 128 characters, not starting with a digit)",
)
RULE_DURABLE_NOT_ALL_ARCHIVE = Rule(
    "!(has(self.tiers.pvc) || has(self.tiers.gcs)) || "
    "(has(self.tiers.pvc) && !has(self.tiers.pvc.components)) || "
    "(has(self.tiers.gcs) && !has(self.tiers.gcs.components))",
    "every durable tier is an archive tier (has 'components': it keeps only part of the state "
    "and never resumes training), so a pod that loses its RAM could never resume; remove "
    "'components' from tiers.pvc or tiers.gcs, or add a tier that keeps everything",
    ".tiers",
)
RULE_PEER_PORT_NOT_METRICS = Rule(
    f"!has(self.peers) || (has(self.peers.port) ? self.peers.port : {DEFAULT_PEER_PORT}) != "
    "(has(self.sidecar) && has(self.sidecar.ports) && has(self.sidecar.ports.metrics) ? "
    f"self.sidecar.ports.metrics : {DEFAULT_METRICS_PORT})",
    "peers.port must differ from sidecar.ports.metrics (both are ports of the sidecar); "
    "choose another peers.port",
    ".peers.port",
)
RULE_REQUEST_NOT_ABOVE_LIMIT = Rule(REQUEST_NOT_ABOVE_LIMIT_RULE, REQUEST_ABOVE_LIMIT_MESSAGE)
RULE_EXTENDED_NEEDS_LIMIT = Rule(EXTENDED_NEEDS_LIMIT_RULE, EXTENDED_NEEDS_LIMIT_MESSAGE)
RULE_SECRET_REF = Rule(
    "self.type == 'SecretRef' ? has(self.secretRef) : !has(self.secretRef)",
    "credentials.secretRef is required with type SecretRef and not allowed with WorkloadIdentity",
)

# --- models -----------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
    )


def _rules(*rules: Rule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.cel() for r in rules]}


class RamEverySpec(_Model):
    """When the RAM tier takes a checkpoint (every ``steps`` training steps)."""

    steps: Annotated[int, Field(strict=True, ge=1, le=1_000_000_000)] = 1
    """Training steps between RAM checkpoints; the client's save() is a no-op in between."""


class RamTierSpec(_Model):
    """The RAM tier: a tmpfs (emptyDir medium Memory, or a node tmpfs via hostPath)."""

    model_config = ConfigDict(json_schema_extra=_rules(RULE_HOST_PATH_MEDIUM))

    medium: Literal["Memory", "HostPath"] = "Memory"
    """Memory: emptyDir medium Memory (survives container restarts, not pod deletion).
    HostPath: a node tmpfs directory (survives a pod rescheduled onto the same node; refused
    in namespaces enforcing the baseline or restricted Pod Security Standard)."""
    size_limit: SizeLimit
    """Bytes the RAM tier may hold (Kubernetes quantity, e.g. 16Gi): the emptyDir sizeLimit and
    the part of the sidecar's memory limit that the slot ring takes."""
    host_path: HostPath | None = None
    """Node directory for medium HostPath; default /dev/shm/strata."""
    keep: Annotated[int, Field(strict=True, ge=1, le=16)] = 1
    """Committed steps kept per rank (the slot ring holds keep + 1 slots)."""
    every: RamEverySpec = RamEverySpec()

    @model_validator(mode="after")
    def _host_path_medium(self) -> RamTierSpec:
        if self.host_path is not None and self.medium != "HostPath":
            raise ValueError(RULE_HOST_PATH_MEDIUM.message)
        return self


class EverySpec(_Model):
    """When a durable tier is due: every ``steps`` and/or every ``duration``, whichever first."""

    model_config = ConfigDict(json_schema_extra=_rules(RULE_EVERY_NOT_EMPTY))

    steps: Annotated[int, Field(strict=True, ge=1, le=1_000_000_000)] | None = None
    """Training steps between promotions to this tier."""
    duration: Duration | None = None
    """Wall time between promotions (Go duration: 90s, 15m, 1h30m)."""

    @model_validator(mode="after")
    def _not_empty(self) -> EverySpec:
        if self.steps is None and self.duration is None:
            raise ValueError(RULE_EVERY_NOT_EMPTY.message)
        return self

    @property
    def seconds(self) -> float | None:
        return None if self.duration is None else parse_duration(self.duration)


def _shared_fields_last(schema: dict[str, Any], cls: type) -> None:
    """Move the fields a durable tier inherits behind its own in the JSON schema (pydantic lists
    a base class's fields first)."""
    properties = schema.get("properties") or {}
    for name in ("components", "incremental"):
        if name in properties:
            properties[name] = properties.pop(name)


class DurableTierSpec(_Model):
    """What every durable tier (PVC, GCS) adds to its location, ``every`` and ``keep``: which
    parts of the state it keeps (an archive tier) and whether it stores incremental copies.

    Each durable tier declares its own ``every`` and ``keep`` (their defaults differ per tier).
    In the schema these shared fields come after the tier's own (:func:`_shared_fields_last`),
    the order ``kubectl explain`` shows."""

    model_config = ConfigDict(json_schema_extra=_shared_fields_last)

    components: (
        Annotated[
            list[ComponentName],
            Field(min_length=1, max_length=32, json_schema_extra=_rules(RULE_COMPONENTS_UNIQUE)),
        ]
        | None
    ) = None
    """Archive tier: keep only these top-level keys of the saved state (e.g. [model]: weights,
    not optimizer state), at this tier's own every/keep. Its steps are archive-only: listed,
    verified and exported (strata export), never used to resume training. Unset: everything."""
    incremental: Annotated[bool, Field(strict=True)] = True
    """Store a step whose bytes mostly equal an earlier full step here (e.g. a frozen base
    under LoRA) as an incremental copy that references them instead of writing them again."""

    @model_validator(mode="after")
    def _components_unique(self) -> Self:
        if self.components is not None and len(set(self.components)) != len(self.components):
            raise ValueError(RULE_COMPONENTS_UNIQUE.message)
        return self


class PvcTierSpec(DurableTierSpec):
    """The shared-filesystem tier: a PersistentVolumeClaim (Filestore, Lustre, NFS; RWX)."""

    claim_name: ObjectName
    """Name of a PersistentVolumeClaim in the policy's namespace (ReadWriteMany for multi-pod
    jobs)."""
    sub_path: RelativePath | None = None
    """Directory inside the volume that holds the checkpoints (relative, no '.' or '..')."""
    every: EverySpec = EverySpec(steps=100)
    keep: Annotated[int, Field(strict=True, ge=1, le=1000)] = 2
    """Complete steps kept on the PVC; the newest complete step is never deleted first."""


class SecretKeyRefSpec(_Model):
    """A key of a Secret in the policy's namespace holding a service-account JSON key."""

    name: ObjectName
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")] = (
        "key.json"
    )


class GcsCredentialsSpec(_Model):
    """How the sidecar authenticates to GCS (workload identity unless a Secret is named)."""

    model_config = ConfigDict(json_schema_extra=_rules(RULE_SECRET_REF))

    type: Literal["WorkloadIdentity", "SecretRef"] = "WorkloadIdentity"
    """WorkloadIdentity: the pod's Kubernetes service account (GKE Workload Identity Federation).
    SecretRef: a service-account JSON key from secretRef."""
    secret_ref: SecretKeyRefSpec | None = None

    @model_validator(mode="after")
    def _secret_ref(self) -> GcsCredentialsSpec:
        if (self.type == "SecretRef") != (self.secret_ref is not None):
            raise ValueError(RULE_SECRET_REF.message)
        return self


class GcsTierSpec(DurableTierSpec):
    """The object-store tier: ``gs://<bucket>/<prefix>/<job id>/steps/...``."""

    bucket: BucketName
    """GCS bucket name (https://cloud.google.com/storage/docs/buckets#naming)."""
    prefix: GcsPrefix = ""
    """Object name prefix inside the bucket (no leading or trailing '/', at most 256 bytes, so
    that every object name stays within GCS' 1,024 bytes)."""
    every: EverySpec = EverySpec(steps=1000)
    keep: Annotated[int, Field(strict=True, ge=1, le=1000)] = 3
    """Complete steps kept in the bucket."""
    credentials: GcsCredentialsSpec = GcsCredentialsSpec()
    endpoint: GcsEndpoint | None = None
    """API endpoint of a GCS-compatible service, ``http[s]://host[:port]``: a Private Service
    Connect endpoint (``https://storage-<name>.p.googleapis.com``), or an emulator
    (``http://``: anonymous credentials, data in the clear: for tests and demos only). Used by
    the sidecar and by the operator's bucket check. Unset: ``https://storage.googleapis.com``."""


class TiersSpec(_Model):
    """The tiers checkpoints flow through: RAM (always), then PVC and GCS when configured."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            RULE_PVC_STEPS_MULTIPLE,
            RULE_GCS_STEPS_MULTIPLE,
            RULE_GCS_STEPS_NOT_SHORTER,
            RULE_GCS_DURATION_NOT_SHORTER,
        )
    )

    ram: RamTierSpec
    pvc: PvcTierSpec | None = None
    gcs: GcsTierSpec | None = None

    @model_validator(mode="after")
    def _intervals(self) -> TiersSpec:
        ram_steps = self.ram.every.steps
        problems: list[str] = []
        if self.pvc and self.pvc.every.steps and self.pvc.every.steps % ram_steps:
            problems.append(RULE_PVC_STEPS_MULTIPLE.message)
        if self.gcs and self.gcs.every.steps and self.gcs.every.steps % ram_steps:
            problems.append(RULE_GCS_STEPS_MULTIPLE.message)
        if self.gcs and self.pvc:
            gs, ps = self.gcs.every.steps, self.pvc.every.steps
            if gs and ps and gs < ps:
                problems.append(RULE_GCS_STEPS_NOT_SHORTER.message)
            gd, pd = self.gcs.every.seconds, self.pvc.every.seconds
            if gd is not None and pd is not None and gd < pd:
                problems.append(RULE_GCS_DURATION_NOT_SHORTER.message)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RestoreSpec(_Model):
    """How a restarted pod finds its checkpoint."""

    order: (
        Annotated[
            list[TierName],
            Field(min_length=1, max_length=3, json_schema_extra=_rules(RULE_ORDER_UNIQUE)),
        ]
        | None
    ) = None
    """Tiers to try, nearest first; default: the configured tiers in the order ram, pvc, gcs."""
    verify: Annotated[bool, Field(strict=True)] = True
    """Verify CRC32C checksums of every shard restored (a mismatch falls to the next tier)."""
    allow_fresh_start: Annotated[bool, Field(strict=True)] = False
    """Start from step 0 when no tier holds a restorable step (said loudly in status and
    events); false: the training client's restore() fails instead."""

    @model_validator(mode="after")
    def _unique(self) -> RestoreSpec:
        if self.order is not None and len(set(self.order)) != len(self.order):
            raise ValueError(RULE_ORDER_UNIQUE.message)
        return self


class ResourcesSpec(_Model):
    """Compute resources of the sidecar process (corev1 ResourceRequirements shape and rules).

    The webhook adds the RAM tier's sizeLimit to the memory request and limit; without a cpu
    request it requests the operator's default (250m), lowered to ``limits.cpu`` when smaller.
    """

    model_config = ConfigDict(
        json_schema_extra=_rules(RULE_REQUEST_NOT_ABOVE_LIMIT, RULE_EXTENDED_NEEDS_LIMIT)
    )

    requests: ResourceList = {}
    limits: ResourceList = {}

    @model_validator(mode="after")
    def _requirements(self) -> ResourcesSpec:
        check_requirements(self.requests, self.limits)
        return self


class SidecarPortsSpec(_Model):
    """Ports the sidecar listens on inside the pod."""

    metrics: Annotated[int, Field(strict=True, ge=1024, le=65535)] = DEFAULT_METRICS_PORT
    """Serves /metrics (Prometheus) and /healthz (startup and liveness probes)."""


class SidecarSpec(_Model):
    """The injected checkpoint sidecar (a native sidecar: init container, restartPolicy Always)."""

    image: ImageReference | None = None
    """Sidecar image; unset: the operator's ``--sidecar-image`` (the chart's sidecar.image)."""
    resources: ResourcesSpec = ResourcesSpec()
    """Requests and limits; the webhook adds the RAM tier's sizeLimit to the memory limit."""
    termination_grace_period_seconds: Annotated[int, Field(strict=True, ge=1, le=86400)] | None = (
        None
    )
    """Pod grace period the webhook sets when the pod has a shorter one; the SIGTERM flush of
    the newest RAM step to the PVC must fit in it."""
    ports: SidecarPortsSpec = SidecarPortsSpec()


class PeersSpec(_Model):
    """Peer tier (docs/peers.md): each node's newest RAM step protected in other nodes' RAM.

    Mirrors ``strata.peers.config.PeersConfig``. ``replicate``: ``copies`` full copies on other
    nodes; ``erasure``: Reed-Solomon over groups of ``dataShards`` nodes with ``parityShards``
    parity blocks. ``bandwidth``: bytes/s each direction. ``port``: TCP port of the sidecar's
    mutual-TLS peer server (must differ from ``sidecar.ports.metrics``).
    """

    mode: Literal["replicate", "erasure"] = "replicate"
    copies: Annotated[int, Field(strict=True, ge=1, le=8)] = 1
    data_shards: Annotated[int, Field(strict=True, ge=1, le=64)] = 6
    parity_shards: Annotated[int, Field(strict=True, ge=1, le=16)] = 2
    bandwidth: Annotated[int, Field(strict=True, ge=1024 * 1024, le=MAX_PEER_BANDWIDTH)] = (
        256 * 1024 * 1024
    )
    """Bound on each sidecar's peer traffic, bytes/s each direction: from 1 MiB/s (1048576) up
    to 50 GB/s (50000000000); default 256 MiB/s."""
    port: Annotated[int, Field(strict=True, ge=1024, le=65535)] = DEFAULT_PEER_PORT
    """TCP port of the peer server; must differ from sidecar.ports.metrics."""


class CheckpointPolicySpec(_Model):
    """Desired checkpointing for the workloads that name this policy (label or annotation
    strata.dev/policy)."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            RULE_ORDER_CONFIGURED,
            RULE_ARCHIVE_NOT_FIRST,
            RULE_DURABLE_NOT_ALL_ARCHIVE,
            RULE_PEER_PORT_NOT_METRICS,
        )
    )

    tiers: TiersSpec
    restore: RestoreSpec = RestoreSpec()
    sidecar: SidecarSpec = SidecarSpec()
    peers: PeersSpec | None = None
    """Peer tier (copies of the RAM tier on other nodes of a JobSet or Indexed Job); unset: off."""
    component_every: (
        Annotated[
            dict[str, Annotated[int, Field(strict=True, ge=1, le=1_000_000_000)]],
            Field(min_length=1, max_length=32, json_schema_extra=_rules(RULE_COMPONENT_KEYS)),
        ]
        | None
    ) = None
    """Top-level components of the saved state dict saved at their own cadence (e.g.
    {ema: 100}): snapshotted every N steps and carried unchanged in between; each step's record
    and the restore say from which step each comes."""

    @model_validator(mode="after")
    def _component_keys(self) -> CheckpointPolicySpec:
        for k in self.component_every or {}:
            if len(k) > 128 or not re.match(COMPONENT_PATTERN, k):
                raise ValueError(RULE_COMPONENT_KEYS.message)
        return self

    @model_validator(mode="after")
    def _peer_port(self) -> CheckpointPolicySpec:
        if self.peers is not None and self.peers.port == self.sidecar.ports.metrics:
            raise ValueError(RULE_PEER_PORT_NOT_METRICS.message)
        return self

    @model_validator(mode="after")
    def _durable_not_all_archive(self) -> CheckpointPolicySpec:
        durable = [t for t in (self.tiers.pvc, self.tiers.gcs) if t is not None]
        if durable and all(t.components is not None for t in durable):
            raise ValueError(RULE_DURABLE_NOT_ALL_ARCHIVE.message)
        return self

    @model_validator(mode="after")
    def _order_configured(self) -> CheckpointPolicySpec:
        present = {
            "ram": True,
            "pvc": self.tiers.pvc is not None,
            "gcs": self.tiers.gcs is not None,
        }
        if self.restore.order is not None and not all(present[t] for t in self.restore.order):
            raise ValueError(RULE_ORDER_CONFIGURED.message)
        archive = {
            "pvc": self.tiers.pvc is not None and self.tiers.pvc.components is not None,
            "gcs": self.tiers.gcs is not None and self.tiers.gcs.components is not None,
        }
        if self.restore.order and archive.get(self.restore.order[0], False):
            raise ValueError(RULE_ARCHIVE_NOT_FIRST.message)
        return self

    def configured_tiers(self) -> list[TierName]:
        """Configured tiers in the order ram, pvc, gcs."""
        present = {
            "ram": True,
            "pvc": self.tiers.pvc is not None,
            "gcs": self.tiers.gcs is not None,
        }
        return [t for t in TIER_ORDER if present[t]]


# --- status -----------------------------------------------------------------------------------


class Condition(_Model):
    """A ``metav1.Condition``."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    status: Literal["True", "False", "Unknown"]
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    last_transition_time: datetime
    """When status last changed (not when the condition was last checked)."""
    reason: Annotated[
        str,
        Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"),
    ]
    """CamelCase, machine-readable (strata_operator.conditions lists them)."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """What is wrong and what to do, for humans."""


class TierStepsStatus(_Model):
    """Newest complete step per tier (every rank's manifest committed in that tier)."""

    ram: Annotated[int, Field(ge=0)] | None = None
    pvc: Annotated[int, Field(ge=0)] | None = None
    gcs: Annotated[int, Field(ge=0)] | None = None


class TierMessagesStatus(_Model):
    """A message per tier (only the tiers it concerns)."""

    ram: Annotated[str, Field(max_length=1024)] | None = None
    pvc: Annotated[str, Field(max_length=1024)] | None = None
    gcs: Annotated[str, Field(max_length=1024)] | None = None


class LastRestoreStatus(_Model):
    """Provenance of a job's last restore."""

    tier: SourceName | None = None
    """Tier that served it (``peer``: other nodes' RAM); absent for a fresh start or a failed
    restore."""
    step: Annotated[int, Field(ge=0)] | None = None
    seconds: Annotated[float, Field(ge=0)] | None = None
    """Wall time of the restore (stage into RAM + load), seconds."""
    outcome: Literal["restored", "fresh-start", "failed"] = "restored"
    time: datetime


class LastErrorStatus(_Model):
    tier: SourceName | None = None
    message: Annotated[str, Field(max_length=2048)]
    time: datetime


class FlushStatus(_Model):
    """Whether a termination flush of a job's state fits in its pods' grace period, from the
    sidecar whose flush needs the longest (``pod``; reports of :class:`strata.reports.FlushEstimate`).

    ``secondsNeeded`` = ``stateBytes`` / ``bytesPerSecond`` (the pod's shards of the newest step
    over the throughput of its recent promotions to ``tier``); it must not exceed
    ``budgetSeconds`` (``graceSeconds``, the pod's ``terminationGracePeriodSeconds``, minus the
    sidecar's margin). ``fits`` is absent until a promotion was measured. ``lastFit`` false: the
    pod's last termination flush (of ``lastStep``, ``lastSeconds`` long) missed its deadline or
    failed."""

    pod: Annotated[str, Field(max_length=253)]
    tier: TierName | None = None
    state_bytes: Annotated[int, Field(ge=0)] | None = None
    bytes_per_second: Annotated[float, Field(ge=0)] | None = None
    seconds_needed: Annotated[float, Field(ge=0)] | None = None
    grace_seconds: Annotated[float, Field(gt=0)]
    budget_seconds: Annotated[float, Field(ge=0)]
    fits: bool | None = None
    last_fit: bool | None = None
    last_step: Annotated[int, Field(ge=0)] | None = None
    last_seconds: Annotated[float, Field(ge=0)] | None = None
    time: datetime
    """When the report carrying it was made."""


class JobStatus(_Model):
    """What the sidecars of one job (``<namespace>.<workload>`` or its run id) reported."""

    job_id: Annotated[str, Field(min_length=1, max_length=512)]
    newest_complete_step: TierStepsStatus = TierStepsStatus()
    last_restore: LastRestoreStatus | None = None
    last_error: LastErrorStatus | None = None
    too_small: TierMessagesStatus | None = None
    """Tiers that cannot take ``keep + 1`` steps (promotion to them stopped advancing), with what
    was needed and what the tier has, as the sidecar reported; cleared when the tier takes a step
    again."""
    flush: FlushStatus | None = None
    """Termination flush against the pods' grace period (absent until a sidecar measured one)."""
    update_time: datetime | None = None
    """When a report about this job was last folded in."""


class CheckpointPolicyStatus(_Model):
    """Observed state, written by the operator (conditions) and its report receiver (jobs)."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """metadata.generation of the spec the conditions describe."""
    conditions: Annotated[
        list[Condition],
        Field(
            max_length=MAX_CONDITIONS,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        ),
    ] = []
    newest_complete_step: TierStepsStatus | None = None
    """Newest complete step per tier of the most recently reported job (printer columns)."""
    jobs: Annotated[
        list[JobStatus],
        Field(
            max_length=MAX_JOBS,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["jobId"],
            },
        ),
    ] = []


class CheckpointPolicy(_Model):
    """A CheckpointPolicy object (only ``spec`` and ``status``; metadata is the apiserver's)."""

    spec: CheckpointPolicySpec
    status: CheckpointPolicyStatus | None = None
