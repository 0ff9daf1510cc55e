"""Why a pod cannot be injected: the refusals of the pod webhook, as pure functions.

Rule of this module: pure (pod dict in, list of problems out), no Kubernetes calls, no kopf. Each
problem names the object and the setting, and says what to change; the webhook joins them into
one denial that starts with "Strata:".

Strata owns a few names in an injected pod (:mod:`strata_operator.constants`): the sidecar
container, the volumes ``strata-ram``/``strata-pvc``/``strata-token``/``strata-tmp``, the mount
paths of the tiers, the env vars ``STRATA_*`` and the downward-API identity vars, the metrics port and the
``strata.dev/injected`` and ``strata.dev/report-ca`` annotations. A pod that already uses one of
them for something else would silently run with the user's object instead of Strata's (a hostPath
named ``strata-ram`` as the RAM tier, a literal ``POD_NAME`` as the rank identity), so such a pod
is refused rather than injected. The one exception is a pod Strata already injected (the API
server calls the webhook again after later admission plugins): see :func:`is_injected`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from strata_operator.constants import (
    CONFIG_ENV,
    INJECTED_ANNOTATION,
    MAX_ANNOTATIONS_BYTES,
    METRICS_PORT_NAME,
    OWNED_ANNOTATIONS,
    POD_FIELD_ENV,
    POLICY_LABEL,
    SIDECAR_NAME,
    STRATA_ENV_PREFIX,
    TOKEN_VOLUME,
    VOLUMES,
)

Obj = dict[str, Any]
_REMEDY = f"or remove the label {POLICY_LABEL} to run the pod without Strata"


def _containers(spec: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    for field in ("initContainers", "containers"):
        for c in spec.get(field) or []:
            if isinstance(c, Mapping):
                yield field, c


def is_injected(pod: Mapping[str, Any]) -> bool:
    """True when Strata injected ``pod`` already (the webhook is called again on reinvocation).

    Both marks must be there: the ``strata.dev/injected`` annotation and a ``strata-sidecar`` init
    container that carries ``STRATA_CONFIG`` and the token mount. A user's container of that name
    alone is not an injection (it is refused by :func:`conflicts`).
    """
    meta = pod.get("metadata") or {}
    if INJECTED_ANNOTATION not in (meta.get("annotations") or {}):
        return False
    spec = pod.get("spec") or {}
    for c in spec.get("initContainers") or []:
        if c.get("name") != SIDECAR_NAME:
            continue
        env = {e.get("name") for e in c.get("env") or []}
        mounts = {m.get("name") for m in c.get("volumeMounts") or []}
        return CONFIG_ENV in env and TOKEN_VOLUME in mounts
    return False


def fully_injected(pod: Mapping[str, Any]) -> bool:
    """:func:`is_injected` and every training container has ``STRATA_CONFIG``: nothing to add."""
    if not is_injected(pod):
        return False
    containers = (pod.get("spec") or {}).get("containers") or []
    return all(CONFIG_ENV in {e.get("name") for e in c.get("env") or []} for c in containers)


def conflicts(
    pod: Mapping[str, Any],
    *,
    mount_paths: Mapping[str, str],
    metrics_port: int,
    wanted_annotations: Mapping[str, str],
) -> list[str]:
    """Every reason ``pod`` (not injected yet) cannot be injected; ``[]``: it can.

    ``mount_paths``: volume name -> path where Strata mounts it in the training containers.
    ``metrics_port``: the sidecar's port (the pod's containers share one network namespace).
    ``wanted_annotations``: the annotations Strata adds (their size counts against the limit).
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    problems: list[str] = []
    os_name = str((spec.get("os") or {}).get("name") or "").lower()
    if os_name == "windows":
        problems.append(
            "spec.os.name is windows, but the Strata sidecar and its RAM tier (tmpfs) need Linux; "
            f"run the training on Linux nodes {_REMEDY}"
        )
    annotations = meta.get("annotations") or {}
    for key in OWNED_ANNOTATIONS:
        if key in annotations:
            problems.append(f"annotation {key} is written only by the Strata webhook; remove it")
    for field, c in _containers(spec):
        name = c.get("name")
        if name == SIDECAR_NAME:
            what = "an init container" if field == "initContainers" else "a training container"
            problems.append(
                f"{what} is named {SIDECAR_NAME!r}, the name of the Strata sidecar; rename it "
                f"{_REMEDY}"
            )
        problems += _container_conflicts(field, c, mount_paths, metrics_port)
    for v in spec.get("volumes") or []:
        if v.get("name") in VOLUMES:
            problems.append(
                f"volume {v.get('name')!r} uses a name Strata reserves for its own volumes "
                f"({', '.join(VOLUMES)}); rename it"
            )
    size = _annotations_bytes({**annotations, **wanted_annotations})
    if size > MAX_ANNOTATIONS_BYTES:
        problems.append(
            f"the pod's annotations would take {size} bytes with Strata's (report CA "
            f"certificate), over Kubernetes' limit of {MAX_ANNOTATIONS_BYTES} bytes (256 KiB); make the "
            "pod's own annotations smaller"
        )
    return problems


def _container_conflicts(
    field: str, c: Mapping[str, Any], mount_paths: Mapping[str, str], metrics_port: int
) -> list[str]:
    name = c.get("name")
    where = f"{'init container' if field == 'initContainers' else 'container'} {name!r}"
    problems: list[str] = []
    own_fields = dict(POD_FIELD_ENV)
    for e in c.get("env") or []:
        env_name = str(e.get("name") or "")
        if env_name.startswith(STRATA_ENV_PREFIX):
            problems.append(
                f"{where} sets env {env_name}; variables starting with {STRATA_ENV_PREFIX} are "
                "Strata's (the webhook sets them from the policy); remove it"
            )
        elif env_name in own_fields and field == "containers":
            ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            if ref != own_fields[env_name]:
                problems.append(
                    f"{where} sets env {env_name} to something else than the pod's "
                    f"{own_fields[env_name]}; Strata identifies the rank's pod by it: remove it "
                    f"or use valueFrom.fieldRef.fieldPath: {own_fields[env_name]}"
                )
    if field == "containers":
        paths = {path: vol for vol, path in mount_paths.items()}
        for m in c.get("volumeMounts") or []:
            path = str(m.get("mountPath") or "").rstrip("/")
            if path in paths:
                problems.append(
                    f"{where} mounts volume {m.get('name')!r} at {path}, where Strata mounts its "
                    f"{paths[path]} volume; move that mount elsewhere"
                )
    for port in c.get("ports") or []:
        if port.get("name") == METRICS_PORT_NAME or (
            port.get("containerPort") == metrics_port
            and str(port.get("protocol") or "TCP") == "TCP"
        ):
            problems.append(
                f"{where} declares port {port.get('name') or port.get('containerPort')}, which "
                f"the Strata sidecar uses ({METRICS_PORT_NAME}, TCP {metrics_port}); use another "
                "port, or set spec.sidecar.ports.metrics in the policy"
            )
    return problems


def _annotations_bytes(annotations: Mapping[str, Any]) -> int:
    """Size as the apiserver counts it: the bytes of every key and value."""
    return sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items())


__all__ = ["conflicts", "fully_injected", "is_injected"]
