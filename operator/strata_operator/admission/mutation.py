"""Pod and workload mutation as pure functions: object in, RFC 6902 JSON patch out.

The admission handlers in :mod:`strata_operator.admission.webhook` only wire these functions;
everything a pod gets from Strata is decided here, without a cluster, so it is unit tested as plain
data.

What an injected pod gets (every name below is a constant of :mod:`strata_operator.constants`):

* volume ``strata-ram``: ``emptyDir`` with ``medium: Memory`` and ``sizeLimit`` (survives container
  restarts) or ``hostPath`` on a node tmpfs (survives a reschedule onto the same node; not allowed
  under the restricted Pod Security Standard), per ``spec.tiers.ram.medium``;
* volume ``strata-pvc`` (when the policy has a PVC tier): the claim, mounted with its ``subPath``;
* volume ``strata-token``: a projected service-account token for the report audience (the operator
  authenticates reports with a TokenReview) plus the report CA bundle, projected from the pod
  annotation ``strata.dev/report-ca`` through the downward API so that no per-namespace ConfigMap
  or Secret is needed;
* volume ``strata-tmp``: a small ``emptyDir`` (``sizeLimit`` 64Mi) mounted at ``/tmp`` of the
  sidecar only: the sidecar runs with ``readOnlyRootFilesystem``, and Python's ``tempfile`` (and
  any library using it) needs one writable temporary directory;
* the sidecar as a native sidecar (an init container with ``restartPolicy: Always``) appended after
  the existing init containers, so that it starts after them (a network proxy sidecar, data
  staging) and is stopped before them; a ``startupProbe`` on ``/healthz`` holds back the training
  containers until the RAM slots are pre-faulted; its memory request and limit are the RAM tier's
  ``sizeLimit`` plus an overhead, because tmpfs pages are charged to the container that first
  touches them and the sidecar pre-faults the slots (docs/architecture.md "RAM tier and the
  training stall");
* for every training container (``spec.containers``): ``STRATA_CONFIG``
  (:meth:`strata.config.StrataConfig.to_env`), the downward-API identity variables and the RAM and
  PVC mounts;
* with ``spec.peers`` (docs/peers.md): ``STRATA_CONFIG.peers`` with the workload's peer list
  (:func:`strata_operator.admission.peers.workload_peer_ranges`: name patterns, a few hundred
  bytes whatever the job's size), and on the sidecar only: the peer port
  ``strata-peers``, ``STRATA_FAILURE_DOMAIN`` from the ``topology.kubernetes.io/zone`` pod label
  (empty, i.e. unknown, where the cluster does not copy it), and the job's TLS Secret
  (``strata-peers-tls``, read-only at ``/var/run/secrets/strata.dev/peers``); an Indexed Job's
  pod gets ``spec.subdomain`` of the peers' headless Service;
* ``terminationGracePeriodSeconds`` raised to the policy's value (never lowered);
* the annotation ``strata.dev/injected: <policy>``.

Rank identity, from the workload controller's pod labels through the downward API (only labels
present at admission are wired; a missing one is left out, the client then relies on ``RANK``):

====================================  ==============================================
variable                              label
====================================  ==============================================
``STRATA_JOBSET_JOB_INDEX``           ``jobset.sigs.k8s.io/job-index``
``STRATA_JOBSET_JOB_GLOBAL_INDEX``    ``jobset.sigs.k8s.io/job-global-index``
``STRATA_JOBSET_REPLICATED_JOB``      ``jobset.sigs.k8s.io/replicatedjob-name``
``STRATA_COMPLETION_INDEX``           ``batch.kubernetes.io/job-completion-index``
``STRATA_REPLICA_TYPE``               ``training.kubeflow.org/replica-type``
``STRATA_REPLICA_INDEX``              ``training.kubeflow.org/replica-index``
====================================  ==============================================

The patch only adds (plus raising the grace period, and pod-level ``spec.resources`` by the
sidecar's share when the pod sets them): existing init containers, native sidecars, env, mounts and
unknown fields stay as they are. A pod that already uses one of Strata's names (container, volume,
mount path, env, port, annotation) or that cannot run the sidecar (Windows) is refused, never
silently half-injected (:mod:`strata_operator.admission.pod_checks`). It is idempotent: an injected
pod only gets what is missing, so applying the patch and calling :func:`build_pod_patch` again
yields ``[]``. Names are constants of :mod:`strata_operator.constants`. Rule of this module: pure
(no Kubernetes calls, no kopf). A pod that meets the restricted Pod Security Standard still meets it
after injection with the ``Memory`` medium: the sidecar runs as non-root, without privilege
escalation, with all capabilities dropped, a read-only root filesystem and the ``RuntimeDefault``
seccomp profile, and it declares no host port.

Errors: :class:`InjectionError` (a clear message naming the object and the setting) when a pod
cannot be injected; the webhook turns it into a 4xx admission denial.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ValidationError

from strata.config import StrataConfig
from strata.constants import ENV_FAILURE_DOMAIN
from strata.errors import StrataError
from strata.peers.placement import group_sizes
from strata_operator.admission import pod_checks
from strata_operator.admission.peers import (
    PEER_TLS_MOUNT,
    PeerSpecError,
    peer_secret_name,
    peer_service_name,
    workload_peer_ranges,
    workload_size,
)
from strata_operator.api import (
    DEFAULT_HOST_PATH,
    DEFAULT_SIDECAR_IMAGE,
    CheckpointPolicySpec,
)
from strata_operator.api.validation import format_quantity, parse_quantity, quantity_bytes
from strata_operator.constants import (
    CA_FILE,
    INJECTED_ANNOTATION,
    JOB_NAME_LABELS,
    JOBSET_NAME_LABEL,
    METRICS_PORT_NAME,
    PEERS_PORT_NAME,
    PEERS_TLS_VOLUME,
    POD_FIELD_ENV,
    POLICY_LABEL,
    PVC_VOLUME,
    PYTORCHJOB_NAME_LABEL,
    RAM_VOLUME,
    RANK_LABELS,
    REPORT_CA_ANNOTATION,
    RUN_ID_ANNOTATION,
    SIDECAR_NAME,
    TMP_SIZE,
    TMP_VOLUME,
    TOKEN_DIR,
    TOKEN_FILE,
    TOKEN_VOLUME,
    ZONE_LABEL,
)
from strata_operator.sidecar_config import to_sidecar_config

JSONPatchOp = dict[str, Any]
Obj = dict[str, Any]

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GENERATED_SUFFIX_RE = re.compile(r"-+$")


class InjectionError(StrataError, ValueError):
    """A pod or workload cannot be mutated; the message names the object and what to do."""


@dataclass(frozen=True)
class InjectionSettings:
    """Operator-wide settings of the injection (Helm values; flags of ``strata-operator``).

    Sizes are Kubernetes quantities (``"256Mi"``); the policy's values take precedence where the
    policy has one (sidecar image, resources, grace period, RAM size).
    """

    sidecar_image: str = DEFAULT_SIDECAR_IMAGE
    """Image of the sidecar unless the policy names one (``spec.sidecar.image``)."""
    sidecar_command: tuple[str, ...] = ("strata", "sidecar")
    report_endpoint: str | None = None
    """Base URL of the operator's report receiver, e.g. ``https://strata.strata-system.svc:8444``."""
    report_audience: str = "strata.dev"
    """Audience of the projected token; the receiver's TokenReview asks for the same one."""
    report_ca_pem: str | None = None
    """CA bundle the sidecar trusts for the report endpoint (projected as ``ca.crt``)."""
    token_expiration_seconds: int = 3600
    """Projected token lifetime; the kubelet refreshes it at 80 %; minimum 600 (API rule)."""
    memory_overhead: str = "256Mi"
    """Sidecar memory on top of the RAM tier (Python, buffers of promotions)."""
    cpu_request: str = "250m"
    run_as_user: int = 65532
    """UID of the sidecar when neither the pod nor the policy sets one (non-root: restricted PSS)."""
    startup_seconds_per_gib: float = 2.0
    """startupProbe budget for pre-faulting the RAM slots (about 1 GB/s per core, x2 margin)."""


# ---------------------------------------------------------------------------------------------
# Small helpers


def escape_pointer(token: str) -> str:
    """Escape one JSON-pointer reference token (RFC 6901): ``~`` -> ``~0``, ``/`` -> ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")


def format_bytes(n: int) -> str:
    """Bytes as the shortest exact binary quantity (``1073741824`` -> ``"1Gi"``)."""
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        if n and n % quantity_bytes(f"1{suffix}") == 0:
            return format_quantity(n, suffix)
    return format_quantity(n)


def _as_plain(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return obj


@dataclass(frozen=True)
class PolicyView:
    """A validated ``CheckpointPolicy`` spec and the policy's name."""

    name: str
    spec: CheckpointPolicySpec

    @classmethod
    def of(cls, policy: Any, name: str | None = None, namespace: str = "") -> PolicyView:
        """Accept a CheckpointPolicy object (dict with ``metadata``/``spec``), a spec dict, or
        a :class:`CheckpointPolicySpec`; :class:`InjectionError` naming each bad field."""
        if isinstance(policy, CheckpointPolicySpec):
            spec_raw: Any = policy
        else:
            plain = _as_plain(policy)
            if not isinstance(plain, Mapping):
                raise InjectionError(f"policy must be a mapping or a model, got {type(policy)}")
            if "spec" in plain:
                name = name or (plain.get("metadata") or {}).get("name")
                spec_raw = plain["spec"]
            else:
                spec_raw = plain
        if not name:
            raise InjectionError("the CheckpointPolicy has no name (metadata.name)")
        if isinstance(spec_raw, CheckpointPolicySpec):
            return cls(name=str(name), spec=spec_raw)
        try:
            spec = CheckpointPolicySpec.model_validate(_as_plain(spec_raw) or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"spec.{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
            where = f"{namespace}/{name}" if namespace else str(name)
            raise InjectionError(
                f"CheckpointPolicy {where} is invalid ({problems}); fix the policy"
            ) from None
        return cls(name=str(name), spec=spec)


# ---------------------------------------------------------------------------------------------
# Identity


def job_id_for(pod: Mapping[str, Any], namespace: str) -> str:
    """``<namespace>.<workload>`` (docs/architecture.md "Identity"), or the ``strata.dev/run-id`` annotation.

    The workload is found from the pod's labels (JobSet, PyTorchJob, Job, in this order: a JobSet's
    pods also carry their child Job's name), then its controller owner reference, then the pod's
    own name or ``generateName`` stem.
    """
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    run_id = annotations.get(RUN_ID_ANNOTATION)
    if run_id:
        if not _JOB_ID_RE.match(run_id) or len(run_id) > 512:
            raise InjectionError(
                f"annotation {RUN_ID_ANNOTATION}={run_id!r} is not a valid run id: use letters, "
                "digits, '.', '_' and '-', starting with a letter or digit, at most 512 characters"
            )
        return str(run_id)
    workload = labels.get(JOBSET_NAME_LABEL) or labels.get(PYTORCHJOB_NAME_LABEL)
    if not workload:
        workload = next((labels[k] for k in JOB_NAME_LABELS if labels.get(k)), None)
    if not workload:
        owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
        workload = owners[0].get("name") if owners else None
    if not workload:
        workload = meta.get("name") or _GENERATED_SUFFIX_RE.sub("", meta.get("generateName") or "")
    if not workload:
        raise InjectionError(
            "cannot derive a Strata job id: the pod has no workload labels, no owner, no name and "
            f"no generateName; set the annotation {RUN_ID_ANNOTATION}"
        )
    return f"{namespace}.{workload}"


# ---------------------------------------------------------------------------------------------
# The pod patch


def build_pod_patch(
    pod: Mapping[str, Any],
    policy: Any,
    settings: InjectionSettings,
    *,
    namespace: str | None = None,
    policy_name: str | None = None,
    workload: Mapping[str, Any] | None = None,
) -> list[JSONPatchOp]:
    """JSON patch (RFC 6902 ops, in order) that injects Strata into ``pod``; ``[]`` if nothing to add.

    ``pod``: the pod as in the admission request (``generateName`` pods have no name yet).
    ``policy``: the ``CheckpointPolicy`` (object dict, spec dict, or
    :class:`~strata_operator.api.CheckpointPolicySpec` with ``policy_name``); the name defaults
    to the pod's ``strata.dev/policy`` label. ``namespace``: the admission request's namespace
    (pods being created may lack ``metadata.namespace``). ``workload``: the pod's JobSet or
    Job as the API returns it; needed (only) when the policy has ``spec.peers``.

    Raises :class:`InjectionError` when the pod cannot be injected (a container already uses the
    sidecar's name, an invalid run id, an invalid policy).
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    ns = namespace or meta.get("namespace") or "default"
    view = PolicyView.of(policy, policy_name or labels.get(POLICY_LABEL), ns)
    pol = view.spec
    name = meta.get("name") or f"{meta.get('generateName') or ''}<generated>"
    pod_desc = f"pod {ns}/{name}"

    containers: list[Obj] = list(spec.get("containers") or [])
    init_containers: list[Obj] = list(spec.get("initContainers") or [])
    injected = pod_checks.is_injected(pod)

    ram_bytes = quantity_bytes(pol.tiers.ram.size_limit)
    existing_grace = spec.get("terminationGracePeriodSeconds")
    # The apiserver defaults the field to 30 before admission; 0 (kill at once) is kept as 0.
    current = 30 if existing_grace is None else int(existing_grace)
    grace = max(current, pol.sidecar.termination_grace_period_seconds or 0)

    job_id = job_id_for(pod, ns)
    peers: list[dict[str, Any]] | None = None
    if pol.peers is not None:
        if workload is None:
            raise InjectionError(
                f"{pod_desc}: policy {view.name} has spec.peers, which needs a JobSet or an "
                "Indexed Job; run the pod under one or use a policy without peers"
            )
        try:
            peers = workload_peer_ranges(workload, pol.peers.port)
        except PeerSpecError as exc:
            raise InjectionError(f"{pod_desc}: {exc}") from None
        misfit = _peers_misfit(pol, workload_size(workload))
        if misfit:
            raise InjectionError(f"{pod_desc}: policy {view.name}: {misfit}")
    try:
        config = to_sidecar_config(
            pol,
            job_id,
            policy=view.name,
            namespace=ns,
            report_endpoint=settings.report_endpoint,
            report_ca_path=f"{TOKEN_DIR}/{CA_FILE}" if settings.report_ca_pem else None,
            # A grace period of 0 leaves no time for the SIGTERM flush; the contract needs > 0.
            termination_grace_seconds=float(max(grace, 1)),
            peer_ranges=peers,
        )
    except ValidationError as exc:
        raise InjectionError(f"{pod_desc}: cannot build the sidecar configuration: {exc}") from None
    env = _identity_env(labels, config)
    ops: list[JSONPatchOp] = []

    # metadata: marker and report CA (projected into the token volume by the downward API)
    wanted_annotations = {INJECTED_ANNOTATION: view.name}
    if settings.report_ca_pem:
        wanted_annotations[REPORT_CA_ANNOTATION] = settings.report_ca_pem
    if not injected:
        mount_paths = {m["name"]: m["mountPath"] for m in _tier_mounts(pol, config)}
        problems = pod_checks.conflicts(
            pod,
            mount_paths=mount_paths,
            metrics_port=config.metrics_port,
            wanted_annotations=wanted_annotations,
        )
        if problems:
            raise InjectionError(f"{pod_desc} cannot be injected: " + "; ".join(problems))
    missing = {k: v for k, v in wanted_annotations.items() if k not in annotations}
    if missing and not meta.get("annotations"):
        ops.append({"op": "add", "path": "/metadata/annotations", "value": missing})
    else:
        ops += [
            {"op": "add", "path": f"/metadata/annotations/{escape_pointer(k)}", "value": v}
            for k, v in missing.items()
        ]

    # volumes
    have_volumes = {v.get("name") for v in spec.get("volumes") or []}
    wanted_volumes = _volumes(pol, settings, ram_bytes)
    if pol.peers is not None:
        # Readable by the sidecar's non-root UID; no other container mounts it.
        secret = {"secretName": peer_secret_name(job_id), "defaultMode": 0o444}
        wanted_volumes.append({"name": PEERS_TLS_VOLUME, "secret": secret})
    new_volumes = [v for v in wanted_volumes if v["name"] not in have_volumes]
    ops += _add_items("/spec/volumes", bool(spec.get("volumes")), new_volumes)

    # terminationGracePeriodSeconds: raised, never lowered
    if existing_grace is None or int(existing_grace) < grace:
        op = "replace" if "terminationGracePeriodSeconds" in spec else "add"
        ops.append({"op": op, "path": "/spec/terminationGracePeriodSeconds", "value": grace})

    # the native sidecar, after the existing init containers
    if not any(c.get("name") == SIDECAR_NAME for c in init_containers):
        sidecar = _sidecar_container(spec, pol, settings, env, ram_bytes, config)
        ops += _add_items("/spec/initContainers", bool(init_containers), [sidecar])
        ops += _pod_level_resources(spec, sidecar["resources"])
    if (
        pol.peers is not None
        and workload is not None
        and workload.get("kind") == "Job"
        and not spec.get("subdomain")
    ):
        name_of_job = (workload.get("metadata") or {}).get("name", "")
        ops.append(
            {"op": "add", "path": "/spec/subdomain", "value": peer_service_name(name_of_job)}
        )

    # env and mounts of every training container
    mounts = _tier_mounts(pol, config)
    for i, container in enumerate(containers):
        base = f"/spec/containers/{i}"
        have_env = {e.get("name") for e in container.get("env") or []}
        ops += _add_items(
            f"{base}/env", bool(container.get("env")), [e for e in env if e["name"] not in have_env]
        )
        have_mounts = container.get("volumeMounts") or []
        used_paths = {m.get("mountPath") for m in have_mounts}
        used_names = {m.get("name") for m in have_mounts}
        new_mounts = [
            m for m in mounts if m["mountPath"] not in used_paths and m["name"] not in used_names
        ]
        ops += _add_items(f"{base}/volumeMounts", bool(have_mounts), new_mounts)
    return ops


def _peers_misfit(pol: CheckpointPolicySpec, n: int) -> str | None:
    """Why the policy's ``spec.peers`` cannot place its copies or parity over a job of ``n``
    pods (each pod on its own node at best), or None. The same bounds as the sidecar's placement
    (:mod:`strata.peers.placement`), checked where the job size is first known."""
    spec = pol.peers
    if spec is None:
        return None
    if spec.mode == "replicate":
        if spec.copies > n - 1:
            return (
                f"peers.copies is {spec.copies} but the job has {n} pod(s), so at most "
                f"{n - 1} other pod(s) can hold copies; lower peers.copies to at most "
                f"{max(n - 1, 1)} or run more pods"
                + (" (a single-pod job has no peers: remove spec.peers)" if n < 2 else "")
            )
        return None
    biggest = group_sizes(n, spec.data_shards)[0]
    if biggest + spec.parity_shards > n:
        return (
            f"peers RS(dataShards={spec.data_shards}, parityShards={spec.parity_shards}) over "
            f"{n} pod(s): a group of {biggest} plus {spec.parity_shards} parity holders needs "
            f"{biggest + spec.parity_shards} pods on distinct nodes; lower peers.dataShards or "
            "peers.parityShards, use mode: replicate, or run more pods"
        )
    return None


def _add_items(path: str, exists: bool, items: list[Obj]) -> list[JSONPatchOp]:
    """Append ``items`` to the list at ``path``, creating the list when absent or empty."""
    if not items:
        return []
    if not exists:
        return [{"op": "add", "path": path, "value": items}]
    return [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def _identity_env(labels: Mapping[str, str], config: StrataConfig) -> list[Obj]:
    env: list[Obj] = [{"name": k, "value": v} for k, v in config.to_env().items()]
    env += [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in POD_FIELD_ENV
    ]
    env += [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
        for name, label in RANK_LABELS
        if label in labels
    ]
    return env


def _volumes(pol: CheckpointPolicySpec, settings: InjectionSettings, ram_bytes: int) -> list[Obj]:
    ram = pol.tiers.ram
    if ram.medium == "HostPath":
        ram_volume: Obj = {
            "name": RAM_VOLUME,
            "hostPath": {"path": ram.host_path or DEFAULT_HOST_PATH, "type": "DirectoryOrCreate"},
        }
    else:
        ram_volume = {
            "name": RAM_VOLUME,
            "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(ram_bytes)},
        }
    volumes = [ram_volume]
    if pol.tiers.pvc is not None:
        claim = pol.tiers.pvc.claim_name
        volumes.append({"name": PVC_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    sources: list[Obj] = [
        {
            "serviceAccountToken": {
                "audience": settings.report_audience,
                "expirationSeconds": settings.token_expiration_seconds,
                "path": TOKEN_FILE,
            }
        }
    ]
    if settings.report_ca_pem:
        ref = f"metadata.annotations['{REPORT_CA_ANNOTATION}']"
        sources.append(
            {"downwardAPI": {"items": [{"path": CA_FILE, "fieldRef": {"fieldPath": ref}}]}}
        )
    volumes.append({"name": TOKEN_VOLUME, "projected": {"sources": sources, "defaultMode": 0o444}})
    volumes.append({"name": TMP_VOLUME, "emptyDir": {"sizeLimit": TMP_SIZE}})
    return volumes


def _tier_mounts(pol: CheckpointPolicySpec, config: StrataConfig) -> list[Obj]:
    mounts: list[Obj] = [{"name": RAM_VOLUME, "mountPath": config.ram.path}]
    if pol.tiers.pvc is not None and config.pvc is not None:
        mount: Obj = {"name": PVC_VOLUME, "mountPath": config.pvc.path}
        if pol.tiers.pvc.sub_path:
            mount["subPath"] = pol.tiers.pvc.sub_path
        mounts.append(mount)
    return mounts


def _sidecar_resources(
    pol: CheckpointPolicySpec, settings: InjectionSettings, ram_bytes: int
) -> Obj:
    """Requests/limits: the policy's ``spec.sidecar.resources`` for the process, plus the RAM tier.

    Memory request = limit = RAM ``sizeLimit`` + the process memory (the policy's memory limit or
    request, else the overhead setting): the pre-faulted slots are charged to the sidecar, and an
    equal request keeps the scheduler honest about it. No CPU limit unless the policy sets one:
    throttling would stretch promotions (RPO).
    """
    requests = dict(pol.sidecar.resources.requests)
    limits = dict(pol.sidecar.resources.limits)
    process_memory = limits.get("memory") or requests.get("memory") or settings.memory_overhead
    total = ram_bytes + quantity_bytes(process_memory)
    if "cpu" not in requests:
        # Never above the policy's cpu limit (a request above its limit is invalid).
        cpu_limit = limits.get("cpu")
        default = settings.cpu_request
        too_high = cpu_limit is not None and parse_quantity(cpu_limit) < parse_quantity(default)
        requests["cpu"] = cpu_limit if too_high and cpu_limit is not None else default
    requests["memory"] = format_bytes(total)
    limits["memory"] = format_bytes(total)
    return {"requests": requests, "limits": limits}


def _training_security(pod_spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """securityContext of the first training container that sets a non-root runAsUser."""
    for container in pod_spec.get("containers") or []:
        sc = container.get("securityContext") or {}
        if isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0:
            return sc
    return {}


def _sidecar_container(
    pod_spec: Mapping[str, Any],
    pol: CheckpointPolicySpec,
    settings: InjectionSettings,
    env: list[Obj],
    ram_bytes: int,
    config: StrataConfig,
) -> Obj:
    port = config.metrics_port
    startup_budget = 30 + math.ceil(ram_bytes / (1 << 30) * settings.startup_seconds_per_gib)
    period = 2
    security: Obj = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod_security = pod_spec.get("securityContext") or {}
    if not pod_security.get("runAsUser"):
        # The sidecar creates the slot files and step directories the trainer writes into (and
        # deletes the trainer's): run it as the training container's UID/GID when one is set,
        # so both sides own the RAM tier. Otherwise a numeric non-root UID of our own, since
        # runAsNonRoot needs a numeric UID when the image's USER is a name.
        trainer = _training_security(pod_spec)
        security["runAsUser"] = trainer.get("runAsUser") or settings.run_as_user
        if trainer.get("runAsGroup") and not pod_security.get("runAsGroup"):
            security["runAsGroup"] = trainer["runAsGroup"]
    mounts = _tier_mounts(pol, config)
    mounts.append({"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})
    mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})
    container: Obj = {
        "name": SIDECAR_NAME,
        "image": pol.sidecar.image or settings.sidecar_image,
        "command": list(settings.sidecar_command),
        "restartPolicy": "Always",
        "env": env,
        "resources": _sidecar_resources(pol, settings, ram_bytes),
        "securityContext": security,
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": port},
            "periodSeconds": period,
            "failureThreshold": max(1, math.ceil(startup_budget / period)),
            "timeoutSeconds": 1,
        },
    }
    if config.peers is not None:
        zone = f"metadata.labels['{ZONE_LABEL}']"
        container["env"] = [
            *env,
            {"name": ENV_FAILURE_DOMAIN, "valueFrom": {"fieldRef": {"fieldPath": zone}}},
        ]
        mounts.append({"name": PEERS_TLS_VOLUME, "mountPath": PEER_TLS_MOUNT, "readOnly": True})
    if not pod_spec.get("hostNetwork"):
        # With hostNetwork every declared port must also be a hostPort (API validation), which
        # the baseline PSS forbids; the probe needs no declared port.
        container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": port, "protocol": "TCP"}]
        if config.peers is not None:
            container["ports"].append(
                {"name": PEERS_PORT_NAME, "containerPort": config.peers.port, "protocol": "TCP"}
            )
    return container


def _format_quantity(value: Decimal) -> str:
    """A quantity value as a short string: whole numbers plain, else millis rounded up."""
    return format_quantity(value, "" if value == value.to_integral_value() else "m")


def _pod_level_resources(spec: Mapping[str, Any], sidecar: Mapping[str, Any]) -> list[JSONPatchOp]:
    """Raise pod-level ``spec.resources`` (PodLevelResources) by what the sidecar adds.

    The apiserver requires pod-level requests >= the sum of the containers' requests, and the pod
    limit bounds every container; the sidecar's requests and limits are added to each resource
    the pod sets at pod level, so the training containers keep their share. A pod-level limit of
    a resource the sidecar requests without a limit (cpu, by default) is raised by the request.
    """
    pod_resources = spec.get("resources")
    if not isinstance(pod_resources, Mapping):
        return []
    ops: list[JSONPatchOp] = []
    for kind in ("requests", "limits"):
        current = pod_resources.get(kind)
        if not isinstance(current, Mapping):
            continue
        share = dict(sidecar.get(kind) or {})
        if kind == "limits":
            # A pod-level limit bounds the sidecar too: where the sidecar has a request but no
            # limit (cpu by default), the pod's limit grows by that request, or the raised pod
            # request would exceed the pod limit (the apiserver refuses that pod).
            share = {**(sidecar.get("requests") or {}), **share}
        for name, value in share.items():
            if name not in current:
                continue
            total = parse_quantity(str(current[name])) + parse_quantity(str(value))
            ops.append(
                {
                    "op": "replace",
                    "path": f"/spec/resources/{kind}/{escape_pointer(name)}",
                    "value": _format_quantity(total),
                }
            )
    return ops
