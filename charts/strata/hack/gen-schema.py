#!/usr/bin/env python3
"""Generate ``values.schema.json`` of the Strata chart from ``values.yaml``.

The schema is derived, not hand-written, so it cannot drift from the values file:

- every key of ``values.yaml`` becomes a property whose type is its default's type and whose
  description is the ``# --`` comment above it (a key without one is an error: every value must
  be documented);
- every object gets ``additionalProperties: false``, so a misspelt value fails ``helm install``,
  except the free-form Kubernetes objects listed in ``FREE_FORM`` (labels, resources, ...);
- ``CONSTRAINTS`` adds enums and ranges that a default cannot express.

Usage: ``gen-schema.py`` writes the file; ``gen-schema.py --check`` exits 1 when it is stale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent.parent
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"

# Kubernetes objects passed through verbatim: their own API validates them.
FREE_FORM = {
    "commonLabels",
    "serviceAccount.annotations",
    "resources",
    "podSecurityContext",
    "securityContext",
    "podAnnotations",
    "podLabels",
    "nodeSelector",
    "affinity",
    "metrics.serviceMonitor.labels",
    "metrics.podMonitor.labels",
    "metrics.prometheusRule.labels",
    "metrics.prometheusRule.alertLabels",
    "metrics.grafanaDashboard.labels",
}
# Item schemas of list values (a default of [] says nothing about its items).
LIST_ITEMS: dict[str, dict[str, Any]] = {
    "imagePullSecrets": {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    },
    "operator.extraEnv": {"type": "object", "required": ["name"]},
    "operator.extraArgs": {"type": "string"},
    "tolerations": {"type": "object"},
    "webhook.excludedNamespaces": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
    "metrics.podMonitor.namespaces": {
        "type": "string",
        "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    },
}
PORT = {"minimum": 1, "maximum": 65535}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "image.pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "operator.logLevel": {"enum": ["info", "verbose", "debug"]},
    "operator.logFormat": {"enum": ["json", "text"]},
    "ports.webhook": PORT,
    "ports.reports": PORT,
    "ports.health": PORT,
    "ports.metrics": PORT,
    "service.reportsPort": PORT,
    "service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "webhook.failurePolicy": {"enum": ["Fail", "Ignore"]},
    "webhook.timeoutSeconds": {"minimum": 1, "maximum": 30},
    "certManager.issuerRef.kind": {"enum": ["Issuer", "ClusterIssuer"]},
    "reports.audience": {"minLength": 1},
    "livenessProbe.initialDelaySeconds": {"minimum": 0},
    "livenessProbe.periodSeconds": {"minimum": 1},
    "livenessProbe.timeoutSeconds": {"minimum": 1},
    "livenessProbe.failureThreshold": {"minimum": 1},
    "terminationGracePeriodSeconds": {"minimum": 0},
    # 0 replicas would leave a `failurePolicy: Fail` webhook with no backend: every protected pod
    # refused. Scaling to 0 on purpose is `helm uninstall`.
    "replicaCount": {"minimum": 1},
    # Checked against terminationGracePeriodSeconds in templates/deployment.yaml.
    "shutdownDelaySeconds": {"minimum": 0},
    "metrics.prometheusRule.noDurableStepMinutes": {"minimum": 1},
    "metrics.prometheusRule.promotionSlowSeconds": {"minimum": 1},
    "metrics.prometheusRule.saveStallSeconds": {"exclusiveMinimum": 0},
}

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):")


def comments_by_path(text: str) -> dict[str, str]:
    """Map ``a.b.c`` to the ``# --`` comment block directly above that key (2-space indents)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            block = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and block is not None:
            block.append(stripped[1:].strip())
            continue
        match = KEY.match(line)
        if match is None:
            if not stripped:
                block = None
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        if block is not None:
            out[".".join(k for _, k in stack)] = " ".join(block)
        block = None
    return out


def schema_for(value: Any, path: str, docs: dict[str, str], missing: list[str]) -> dict[str, Any]:
    node: dict[str, Any]
    if isinstance(value, bool):
        node = {"type": "boolean"}
    elif isinstance(value, int):
        node = {"type": "integer"}
    elif isinstance(value, float):
        node = {"type": "number"}
    elif isinstance(value, str):
        node = {"type": "string"}
    elif isinstance(value, list):
        node = {"type": "array"}
        if path in LIST_ITEMS:
            node["items"] = LIST_ITEMS[path]
    elif isinstance(value, dict):
        node = {"type": "object"}
        if path not in FREE_FORM:
            node["additionalProperties"] = False
            node["properties"] = {
                key: schema_for(sub, f"{path}.{key}" if path else key, docs, missing)
                for key, sub in value.items()
            }
    else:
        raise SystemExit(f"{VALUES}: {path} has a null default; give it a typed default")
    if path:
        if path in docs:
            node["description"] = docs[path]
        elif not isinstance(value, dict) or path in FREE_FORM:
            missing.append(path)
    node.update(CONSTRAINTS.get(path, {}))
    return node


def generate() -> str:
    text = VALUES.read_text()
    values = yaml.safe_load(text)
    missing: list[str] = []
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Values of the Strata Helm chart (generated by hack/gen-schema.py; do not edit)",
        **schema_for(values, "", comments_by_path(text), missing),
    }
    unknown = sorted(set(CONSTRAINTS) | set(LIST_ITEMS) | FREE_FORM)
    unknown = [p for p in unknown if not _has_path(values, p)]
    if missing:
        raise SystemExit(f"{VALUES}: undocumented values (add a '# --' comment): {missing}")
    if unknown:
        raise SystemExit(f"{Path(__file__).name}: rules name values that do not exist: {unknown}")
    return json.dumps(schema, indent=2) + "\n"


def _has_path(values: dict[str, Any], path: str) -> bool:
    node: Any = values
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the schema is stale")
    args = parser.parse_args()
    schema = generate()
    if args.check:
        if not SCHEMA.exists() or SCHEMA.read_text() != schema:
            print(f"{SCHEMA} is stale: run charts/strata/hack/gen-schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(schema)
    return 0


if __name__ == "__main__":
    sys.exit(main())
