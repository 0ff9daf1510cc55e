"""The configuration contract between the operator, the sidecar and the training client.

The operator's webhook builds a :class:`StrataConfig` from a ``CheckpointPolicy`` and the pod,
serialises it with :meth:`StrataConfig.to_env` and injects the result into the sidecar *and* every
training container. The sidecar and the client read it back with :meth:`StrataConfig.from_env`.
Because both ends use this one model, they cannot disagree about a setting.

Environment variables (all optional except where said):

``STRATA_CONFIG``
    JSON of the whole model (what the webhook injects). Fields below override it.
``STRATA_JOB_ID``
    ``<namespace>.<workload>`` or the ``strata.dev/run-id`` annotation.
``STRATA_RAM_DIR``, ``STRATA_PVC_DIR``, ``STRATA_GCS_BUCKET``, ``STRATA_GCS_PREFIX``
    Tier locations (for runs outside Kubernetes, e.g. ``make demo``).
``STRATA_SOCKET``
    Unix socket of the sidecar's local API; default ``<ram dir>/.strata/sidecar.sock``.
``STRATA_TERMINATION_GRACE_SECONDS``
    The pod's ``terminationGracePeriodSeconds``: the termination flush's budget.
``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``, ``POD_UID``
    Downward API, set by the webhook.
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
    torch.distributed / torchrun identity (read by the client, not part of this model).

Unknown fields in ``STRATA_CONFIG`` are an error that names the field (``extra="forbid"``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from strata.constants import (
    ENV_CONFIG,
    ENV_GCS_BUCKET,
    ENV_GCS_PREFIX,
    ENV_JOB_ID,
    ENV_NODE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_PVC_DIR,
    ENV_RAM_DIR,
    ENV_SOCKET,
    ENV_TERMINATION_GRACE,
    SOCKET_RELPATH,
)
from strata.errors import ConfigError
from strata.peers.config import PeersConfig

TierName = Literal["ram", "pvc", "gcs"]
TIER_ORDER: tuple[TierName, ...] = ("ram", "pvc", "gcs")
SourceName = Literal["ram", "peer", "pvc", "gcs"]
"""Where a restore can read a shard: the tiers, and ``peer`` (other nodes' RAM, docs/peers.md),
which always comes right after RAM and is not a configurable tier of its own."""
SOURCE_ORDER: tuple[SourceName, ...] = ("ram", "peer", "pvc", "gcs")

DEFAULT_RAM_DIR = "/strata/ram"
DEFAULT_PVC_DIR = "/strata/pvc"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Interval(_Frozen):
    """When a tier is due: every ``steps`` training steps and/or every ``seconds`` of wall time.

    A tier is due when any set bound has elapsed since its last checkpoint. Neither set means
    every committed step (the RAM tier's natural cadence).
    """

    steps: Annotated[int, Field(ge=1)] | None = None
    seconds: Annotated[float, Field(gt=0)] | None = None


class RamTierConfig(_Frozen):
    """RAM tier: a tmpfs directory holding a ring of pre-faulted slot files per rank."""

    path: str = DEFAULT_RAM_DIR
    medium: Literal["Memory", "HostPath"] = "Memory"
    size_limit_bytes: Annotated[int, Field(ge=0)] | None = None
    """Bytes the RAM tier may use (emptyDir ``sizeLimit``); None: unbounded (tests, demo)."""
    keep: Annotated[int, Field(ge=1)] = 1
    """Committed steps kept per rank; the slot ring holds ``keep + 1`` slots (one being written)."""
    every: Interval = Interval(steps=1)


class DurableTierConfig(_Frozen):
    """What the durable tiers (PVC, GCS) share: which parts of the state they keep and whether
    they store incremental copies."""

    components: tuple[Annotated[str, Field(min_length=1)], ...] | None = None
    """Archive tier: keep only these top-level components of the state (e.g.
    ``("model",)``); its steps are archive-only: listed, verified and exported, never used to
    resume training. None: everything (a tier that restores can use)."""
    incremental: bool = True
    """Store a shard whose chunks mostly equal the newest full shard of the same rank here as an
    incremental copy that references them."""


class PvcTierConfig(DurableTierConfig):
    """Shared-filesystem tier (PVC: Filestore, Lustre, NFS) mounted at ``path``."""

    path: str = DEFAULT_PVC_DIR
    claim_name: str | None = None
    sub_path: str | None = None
    keep: Annotated[int, Field(ge=1)] = 2
    every: Interval = Interval(steps=100)


class GcsTierConfig(DurableTierConfig):
    """Google Cloud Storage tier: ``gs://<bucket>/<prefix>/<job id>/steps/...``."""

    bucket: Annotated[str, Field(min_length=3, max_length=222)]
    prefix: str = ""
    keep: Annotated[int, Field(ge=1)] = 3
    every: Interval = Interval(steps=1000)
    endpoint: str | None = None
    """API endpoint override (fake-gcs-server); default: the real service or STORAGE_EMULATOR_HOST."""
    chunk_size_bytes: Annotated[int, Field(ge=256 * 1024)] = 32 * 1024 * 1024
    """Parts of a parallel chunked (XML multipart) upload/download; 256 KiB multiple."""
    max_workers: Annotated[int, Field(ge=1, le=64)] = 8
    parallel_threshold_bytes: Annotated[int, Field(ge=0)] = 150 * 1024 * 1024
    """Shards larger than this (and than ``chunk_size_bytes``) are uploaded as parallel parts
    composed into one object; smaller ones in one streamed request (composing costs the service
    a copy of the object). 150 MiB is ``gcloud storage``'s default threshold for the same."""


class RestoreConfig(_Frozen):
    order: tuple[TierName, ...] = TIER_ORDER
    verify: bool = True
    allow_fresh_start: bool = False
    """Start from step 0 when no tier holds a restorable step. False: restore() raises instead."""
    load_in_place: bool = True
    """A copy the nearest tier holds as a local file (the PVC) is loaded where it lies: one read
    straight into the live state, verified on the way, nothing staged into RAM (the next save
    writes RAM). False: it is staged into RAM first, then loaded from there (two copies; the
    next restore before a save is a RAM hit). RAM hits, GCS, the peers and incremental copies
    are always staged."""


class ReportConfig(_Frozen):
    """Where the sidecar pushes reports (HTTPS, operator) and how it authenticates."""

    endpoint: str | None = None
    token_path: str = "/var/run/secrets/strata.dev/token"
    ca_path: str | None = None
    timeout_seconds: Annotated[float, Field(gt=0)] = 5.0
    max_attempts: Annotated[int, Field(ge=1)] = 5


class StrataConfig(_Frozen):
    """Everything the sidecar and the training client need; built by the webhook from a policy.

    Errors: :meth:`from_env` raises :class:`ConfigError` naming the setting on invalid input.
    """

    job_id: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    policy: str | None = None
    namespace: str | None = None
    pod_name: str | None = None
    pod_uid: str | None = None
    node_name: str | None = None
    ram: RamTierConfig = RamTierConfig()
    pvc: PvcTierConfig | None = None
    gcs: GcsTierConfig | None = None
    restore: RestoreConfig = RestoreConfig()
    report: ReportConfig = ReportConfig()
    peers: PeersConfig | None = None
    """Peer tier: this node's RAM steps protected on other nodes (docs/peers.md); None: off."""
    socket_path: str | None = None
    """Unix socket of the local API; default ``<ram.path>/.strata/sidecar.sock``."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9464
    """Port of /metrics and /healthz on 0.0.0.0 in a pod; 0 disables."""
    metrics_host: str = "0.0.0.0"
    gc_grace_seconds: Annotated[float, Field(ge=0)] = 600.0
    """Incomplete steps older than the newest complete step are deleted after this long."""
    termination_grace_seconds: Annotated[float, Field(gt=0)] = 30.0
    """The pod's terminationGracePeriodSeconds; the SIGTERM flush deadline is derived from it."""
    writer_id: str | None = None
    """Identity stamped into manifests written by this pod; default ``<pod name or host>``."""
    component_every: dict[str, Annotated[int, Field(ge=1)]] | None = None
    """Top-level components of a dict state saved at their own cadence: name ->
    steps between snapshots, carried in between (:mod:`strata.client.cadence`)."""

    @model_validator(mode="after")
    def _check_tiers(self) -> StrataConfig:
        if len(set(self.restore.order)) != len(self.restore.order):
            raise ValueError(f"restore.order has duplicates: {list(self.restore.order)}")
        archive = self.archive_tiers()
        first = self.restore.order[0] if self.restore.order else None
        if first in archive:
            raise ValueError(
                f"restore.order starts with {first!r}, an archive tier (it keeps only components "
                f"{list(archive[first])}, so it cannot resume training); put a tier that keeps "
                "everything first, or drop its 'components'"
            )
        for name, kept in archive.items():
            if len(set(kept)) != len(kept) or not kept:
                raise ValueError(f"{name}.components must be distinct names, got {list(kept)}")
        return self

    def archive_tiers(self) -> dict[TierName, tuple[str, ...]]:
        """Durable tiers that keep only some components -> those components."""
        out: dict[TierName, tuple[str, ...]] = {}
        if self.pvc is not None and self.pvc.components is not None:
            out["pvc"] = self.pvc.components
        if self.gcs is not None and self.gcs.components is not None:
            out["gcs"] = self.gcs.components
        return out

    def durable(self, name: TierName) -> PvcTierConfig | GcsTierConfig | None:
        """The configuration of durable tier ``name`` ("pvc" or "gcs"; None: not configured,
        or "ram")."""
        return self.pvc if name == "pvc" else self.gcs if name == "gcs" else None

    @property
    def socket(self) -> Path:
        return Path(self.socket_path or os.path.join(self.ram.path, SOCKET_RELPATH))

    @property
    def pod_writer_id(self) -> str:
        """The writer id stamped on data this pod writes (``writer_id``, else the pod name, else
        the host name); a rank's shards carry ``<pod_writer_id>/rank-<r>``. Garbage collection
        deletes only data whose writer id matches, so the client and the sidecar must agree."""
        return self.writer_id or self.pod_name or socket.gethostname()

    def tiers_in_restore_order(self) -> list[SourceName]:
        """Configured tiers in restore order (nearest first); archive tiers never resume; ``peer``
        right after RAM when the peer tier is on (RAM -> peer -> PVC -> GCS)."""
        present = {"ram": True, "pvc": self.pvc is not None, "gcs": self.gcs is not None}
        archive = self.archive_tiers()
        order: list[SourceName] = [t for t in self.restore.order if present[t] and t not in archive]
        if self.peers is not None:
            order.insert(order.index("ram") + 1 if "ram" in order else 0, "peer")
        return order

    def to_env(self) -> dict[str, str]:
        """The env vars the webhook injects (only ``STRATA_CONFIG``; the rest is downward API)."""
        return {ENV_CONFIG: self.model_dump_json(exclude_defaults=True)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StrataConfig:
        """Read ``STRATA_CONFIG`` plus the override variables listed in the module docstring."""
        return cls.parse(cls.raw_from_env(environ))

    @classmethod
    def raw_from_env(cls, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """The settings the environment gives, not yet validated (to merge with arguments).

        Raises :class:`ConfigError` when ``STRATA_CONFIG`` is not a JSON object.
        """
        env = os.environ if environ is None else environ
        raw: dict[str, object] = {}
        if env.get(ENV_CONFIG):
            try:
                loaded = json.loads(env[ENV_CONFIG])
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{ENV_CONFIG} is not valid JSON ({exc}); it is set by the webhook"
                ) from exc
            if not isinstance(loaded, dict):
                raise ConfigError(f"{ENV_CONFIG} must be a JSON object")
            raw.update(loaded)
        overrides = {
            ENV_JOB_ID: ("job_id",),
            ENV_POD_NAME: ("pod_name",),
            ENV_POD_NAMESPACE: ("namespace",),
            ENV_POD_UID: ("pod_uid",),
            ENV_NODE_NAME: ("node_name",),
            ENV_SOCKET: ("socket_path",),
            ENV_TERMINATION_GRACE: ("termination_grace_seconds",),
            ENV_RAM_DIR: ("ram", "path"),
            ENV_PVC_DIR: ("pvc", "path"),
            ENV_GCS_BUCKET: ("gcs", "bucket"),
            ENV_GCS_PREFIX: ("gcs", "prefix"),
        }
        for var, keys in overrides.items():
            value = env.get(var)
            if not value:
                continue
            target = raw
            for key in keys[:-1]:
                sub = target.get(key)
                if not isinstance(sub, dict):
                    sub = {}
                    target[key] = sub
                target = sub
            target[keys[-1]] = value
        return raw

    @classmethod
    def parse(cls, raw: Mapping[str, object]) -> StrataConfig:
        """Validate ``raw``; raise :class:`ConfigError` naming every bad setting."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ConfigError(f"invalid Strata configuration: {problems}") from None
