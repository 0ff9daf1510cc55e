#!/usr/bin/env bash
# Try Strata on your own machine: a kind cluster, the three images built and loaded into it, the
# Helm chart installed (operator-generated webhook certificates, no cert-manager needed), and the
# example policy plus the annotated indexed Job of examples/ run to completion.
#
# Requires Docker (or another engine kind supports), kind, kubectl and helm on PATH (helm may also
# come from `make tools`). The project's own test machines have no container engine, so CI does
# not run this script; the same chart is tested there on a local control plane (e2e/test_helm.py).
#
# Usage: e2e/kind/create-cluster.sh [--name NAME] [--skip-build] [--no-example]
#   KIND_NODE_IMAGE=kindest/node:v1.31.x picks the Kubernetes version (>= 1.29: native sidecars).
# Remove everything with e2e/kind/delete-cluster.sh [--name NAME].
set -euo pipefail
cd "$(dirname "$0")/../.."

name=strata
build=1
example=1
while (( $# )); do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --skip-build) build=0; shift ;;
    --no-example) example=0; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "create-cluster: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/strata/Chart.yaml)"
operator_image="ghcr.io/strata-dev/strata-operator:$version"
sidecar_image="ghcr.io/strata-dev/strata:$version"
train_image="ghcr.io/strata-dev/strata-train:$version"
namespace=strata-system
demo_namespace=strata-demo

log() { printf '\n==> %s\n' "$*"; }
need() {
  command -v "$1" >/dev/null 2>&1 || { echo "create-cluster: $1 is required: $2" >&2; exit 1; }
}
need docker "install Docker (https://docs.docker.com/get-docker/)"
need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
helm="$(command -v helm || true)"
if [[ -z "$helm" ]]; then
  helm="$(bash e2e/build-tools.sh --print-dir)/helm"
  [[ -x "$helm" ]] || { echo "create-cluster: helm is required: install it or run 'make tools'" >&2; exit 1; }
fi
docker info >/dev/null 2>&1 || { echo "create-cluster: the Docker daemon is not reachable" >&2; exit 1; }

if kind get clusters 2>/dev/null | grep -qx "$name"; then
  log "kind cluster $name exists; reusing it"
else
  log "creating kind cluster $name"
  kind create cluster --name "$name" ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --wait 120s
fi
context="kind-$name"
kc() { kubectl --context "$context" "$@"; }

if (( build )); then
  log "building the images (context: the repository root)"
  docker build -f operator/Dockerfile -t "$operator_image" .
  docker build -f sidecar/Dockerfile -t "$sidecar_image" .
  docker build -f examples/Dockerfile -t "$train_image" .
fi
log "loading the images into the cluster"
for image in "$operator_image" "$sidecar_image" "$train_image"; do
  kind load docker-image --name "$name" "$image"
done

log "installing the chart into $namespace (operator-generated certificates)"
"$helm" upgrade --install strata charts/strata --kube-context "$context" \
  --namespace "$namespace" --create-namespace --wait --timeout 5m
"$helm" test strata --kube-context "$context" --namespace "$namespace" --timeout 2m

if (( example )); then
  log "running the example: policy 'demo' and the annotated indexed Job in $demo_namespace"
  kc create namespace "$demo_namespace" --dry-run=client -o yaml | kc apply -f -
  # kind's default storage class (local-path) only offers ReadWriteOnce: one node, so it is enough.
  sed 's/ReadWriteMany/ReadWriteOnce/' examples/pvc.yaml | kc apply -n "$demo_namespace" -f -
  kc apply -n "$demo_namespace" -f examples/policy.yaml
  kc apply -n "$demo_namespace" -f examples/job.yaml
  kc wait -n "$demo_namespace" --for=condition=complete job/strata-train-job --timeout=20m
  kc logs -n "$demo_namespace" -l batch.kubernetes.io/job-name=strata-train-job -c trainer --tail=3
  kc get -n "$demo_namespace" ckpol demo
  cat <<EOF

Done. Things to try next:
  kubectl --context $context -n $demo_namespace describe ckpol demo
  kubectl --context $context -n $demo_namespace get pod -l batch.kubernetes.io/job-name=strata-train-job -o yaml
  # rerun the Job: it resumes from the newest checkpoint on the PVC
  kubectl --context $context -n $demo_namespace delete job strata-train-job
  sed 's/"300"/"400"/' examples/job.yaml | kubectl --context $context -n $demo_namespace apply -f -
Remove the cluster with: e2e/kind/delete-cluster.sh --name $name
EOF
fi
