"""Workload mutation as pure functions: label the pod templates of an annotated workload.

A JobSet, PyTorchJob or Job annotated ``strata.dev/policy: <name>`` gets the label on every pod
template, so that its pods reach the pod webhook (:mod:`strata_operator.admission.mutation`). Rule
of this module: pure (object in, RFC 6902 patch out), no Kubernetes calls, no kopf.

Errors: :class:`strata_operator.admission.mutation.InjectionError` with a message saying what to
change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata_operator.admission.mutation import InjectionError, JSONPatchOp, Obj, escape_pointer
from strata_operator.api.validation import MAX_POLICY_NAME
from strata_operator.constants import POLICY_LABEL, RUN_ID_ANNOTATION

WORKLOAD_KINDS = ("JobSet", "PyTorchJob", "Job")


def pod_template_paths(obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(JSON pointer, template)`` of every pod template of a JobSet, PyTorchJob or Job.

    JobSet: ``spec.replicatedJobs[i].template.spec.template``; PyTorchJob:
    ``spec.pytorchReplicaSpecs.<type>.template``; Job: ``spec.template``.
    """
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    out: list[tuple[str, Mapping[str, Any]]] = []
    if kind == "JobSet":
        for i, rjob in enumerate(spec.get("replicatedJobs") or []):
            tmpl = (((rjob or {}).get("template") or {}).get("spec") or {}).get("template")
            if isinstance(tmpl, Mapping):
                out.append((f"/spec/replicatedJobs/{i}/template/spec/template", tmpl))
    elif kind == "PyTorchJob":
        for rtype, rspec in (spec.get("pytorchReplicaSpecs") or {}).items():
            tmpl = (rspec or {}).get("template")
            if isinstance(tmpl, Mapping):
                out.append((f"/spec/pytorchReplicaSpecs/{escape_pointer(rtype)}/template", tmpl))
    elif kind == "Job":
        tmpl = spec.get("template")
        if isinstance(tmpl, Mapping):
            out.append(("/spec/template", tmpl))
    else:
        raise InjectionError(
            f"unsupported workload kind {kind!r}; expected one of {WORKLOAD_KINDS}"
        )
    return out


def build_workload_patch(obj: Mapping[str, Any]) -> list[JSONPatchOp]:
    """Label every pod template of an annotated workload with ``strata.dev/policy: <name>``.

    The policy comes from the workload's ``strata.dev/policy`` annotation; no annotation: ``[]``.
    The workload's ``strata.dev/run-id`` annotation is copied to the templates too (pods do not
    inherit workload annotations). Templates already labelled keep their label. Idempotent.
    """
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    policy = annotations.get(POLICY_LABEL)
    if not policy:
        return []
    if len(str(policy)) > MAX_POLICY_NAME:
        raise InjectionError(
            f"annotation {POLICY_LABEL}={policy!r} is longer than a label value "
            f"({MAX_POLICY_NAME} characters), so the pods could not carry it; name a policy "
            "with a shorter name"
        )
    run_id = annotations.get(RUN_ID_ANNOTATION)
    ops: list[JSONPatchOp] = []
    for path, tmpl in pod_template_paths(obj):
        tmeta = tmpl.get("metadata")
        if not isinstance(tmeta, Mapping):
            value: Obj = {"labels": {POLICY_LABEL: policy}}
            if run_id:
                value["annotations"] = {RUN_ID_ANNOTATION: run_id}
            ops.append({"op": "add", "path": f"{path}/metadata", "value": value})
            continue
        for field, key, val in (
            ("labels", POLICY_LABEL, policy),
            ("annotations", RUN_ID_ANNOTATION, run_id),
        ):
            if not val:
                continue
            current = tmeta.get(field)
            if not current:
                ops.append({"op": "add", "path": f"{path}/metadata/{field}", "value": {key: val}})
            elif key not in current:
                ops.append(
                    {
                        "op": "add",
                        "path": f"{path}/metadata/{field}/{escape_pointer(key)}",
                        "value": val,
                    }
                )
    return ops
