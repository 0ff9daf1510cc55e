#!/usr/bin/env bash
# Delete the kind cluster made by e2e/kind/create-cluster.sh (and everything in it).
# Usage: e2e/kind/delete-cluster.sh [--name NAME]
set -euo pipefail
name=strata
if [[ "${1:-}" == "--name" ]]; then name="$2"; fi
command -v kind >/dev/null 2>&1 || { echo "delete-cluster: kind is required" >&2; exit 1; }
kind delete cluster --name "$name"
