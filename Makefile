# Strata — every target creates .venv and installs what it needs on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export NO_PROXY := 127.0.0.1,localhost,::1
export no_proxy := 127.0.0.1,localhost,::1

PY_DIRS := sidecar operator tests e2e bench examples charts/strata/hack

.PHONY: maps help venv demo demo-cluster check test test-unit test-integration test-e2e lint fmt typecheck crds crds-check \
        manifests manifests-check dist chart bench bench-sharded bench-smoke scale-large scale-data goodput tools node-prereqs images cluster-up cluster-down scale clean chaos
.PHONY: bench-ready

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP) ## create .venv and install strata with all extras

demo: $(STAMP) ## the main job: train a small LM, checkpoint through RAM -> PVC -> GCS, recover from each tier
	$(BIN)/python -m strata.demo $(DEMO_ARGS)

demo-cluster: $(STAMP) tools images ## the Kubernetes half: the chart-installed operator on a real local node, RAM, PVC and GCS recoveries of real pods (root)
	$(BIN)/python -m e2e.demo_cluster

check: $(STAMP) ## the inner loop (under a minute warm): ruff, format check, mypy, import contracts, unit tests
	$(BIN)/ruff check $(PY_DIRS)
	$(BIN)/ruff format --check $(PY_DIRS)
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -m unit -q -p no:cacheprovider tests $(PYTEST_ARGS)

test: $(STAMP) lint typecheck crds-check tools images manifests-check ## every test: lint, CRD freshness, unit, integration, e2e
	$(BIN)/python -m pytest -p no:cacheprovider tests e2e $(PYTEST_ARGS)

test-unit: $(STAMP) ## unit tests only
	$(BIN)/python -m pytest -m unit tests $(PYTEST_ARGS)

test-integration: $(STAMP) ## integration tests only (tmpfs, fake-gcs-server, processes)
	$(BIN)/python -m pytest -m integration tests $(PYTEST_ARGS)

test-e2e: $(STAMP) tools images ## end-to-end tests on the local control plane
	$(BIN)/python -m pytest e2e $(PYTEST_ARGS)

lint: $(STAMP) ## ruff lint + format check, import contracts
	$(BIN)/ruff check $(PY_DIRS)
	$(BIN)/ruff format --check $(PY_DIRS)
	$(BIN)/lint-imports

fmt: $(STAMP) ## apply ruff formatting and fixes
	$(BIN)/ruff check --fix $(PY_DIRS)
	$(BIN)/ruff format $(PY_DIRS)

typecheck: $(STAMP) ## mypy strict on the packages and the tests
	$(BIN)/mypy

maps: $(STAMP) ## regenerate docs/layout.md and the README's Layout block from the docstrings
	$(BIN)/python -m tests.maps

crds: $(STAMP) ## regenerate crds/ from the pydantic models
	$(BIN)/python -m strata_operator.crdgen --out crds/
	cp crds/checkpointpolicies.strata.dev.yaml charts/strata/files/crds/
	@if [ -x "$$(bash e2e/build-tools.sh --print-dir)/helm" ]; then $(MAKE) --no-print-directory manifests; \
	  else echo "helm is not built yet: run 'make tools manifests' to refresh manifests/strata.yaml"; fi

crds-check: $(STAMP) ## fail when crds/ is not what `make crds` generates
	$(BIN)/python -m strata_operator.crdgen --check crds/

manifests: $(STAMP) ## render manifests/strata.yaml (kubectl apply install) and the chart's values.schema.json (needs helm: make tools)
	$(BIN)/python charts/strata/hack/gen-schema.py
	@mkdir -p manifests
	bash charts/strata/hack/render-manifests.sh > manifests/strata.yaml.tmp
	mv manifests/strata.yaml.tmp manifests/strata.yaml

manifests-check: $(STAMP) tools ## fail when manifests/strata.yaml, the chart's CRD copy or values.schema.json are stale
	$(BIN)/python charts/strata/hack/gen-schema.py --check
	@cmp -s crds/checkpointpolicies.strata.dev.yaml charts/strata/files/crds/checkpointpolicies.strata.dev.yaml \
	  || { echo "charts/strata/files/crds/ differs from crds/: run make crds"; exit 1; }
	@bash charts/strata/hack/render-manifests.sh | cmp -s - manifests/strata.yaml \
	  || { echo "manifests/strata.yaml is stale: run make manifests"; exit 1; }

tools: node-prereqs ## build (or reuse) kube-apiserver, controller-manager, scheduler, kwok, helm, JobSet and PyTorchJob controllers, kubelet and pause into ~/.cache/strata
	bash e2e/build-tools.sh

node-prereqs: ## install what a real node needs from Debian (containerd, runc, CNI plugins, mmdebstrap) when missing and root
	bash e2e/node/prereqs.sh

images: $(STAMP) node-prereqs ## build the sidecar, operator and trainer images from their Dockerfiles (no engine needed) into ~/.cache/strata/images
	$(BIN)/python -m e2e.node.images

cluster-up: $(STAMP) tools ## start the local control plane (etcd, apiserver, controller-manager, scheduler, kwok)
	$(BIN)/python -m e2e.cluster up

cluster-down: $(STAMP) ## stop the local control plane
	$(BIN)/python -m e2e.cluster down

scale: $(STAMP) tools ## scale check, not in `make test`: 1,000 kwok nodes, a 1,000-pod JobSet, 1,000 reporting sidecars -> e2e/results/scale-latest.json; then scale-large
	$(BIN)/python -m e2e.scale $(SCALE_ARGS)
	$(MAKE) --no-print-directory scale-large

scale-large: $(STAMP) tools ## admission of the large jobs: a 20,000-pod Indexed Job, a 4,096-pod JobSet with spec.peers -> e2e/results/scale-{indexed-job,peers}.json
	$(BIN)/python -m e2e.scale --workload indexed-job --pods 20000 --jobs 1 --nodes 200 --rounds 0 --dir .strata-run/scale-indexed-job --out e2e/results/scale-indexed-job.json
	$(BIN)/python -m e2e.scale --workload jobset --peers --pods 4096 --jobs 1 --nodes 64 --rounds 0 --dir .strata-run/scale-peers --out e2e/results/scale-peers.json

scale-data: $(STAMP) ## data-plane scale simulation: tier requests per sidecar per step, W up to 16,384 -> bench/results/scale-data.json
	$(BIN)/python -m bench.scale_data $(SCALE_DATA_ARGS)

goodput: $(STAMP) ## goodput at 1,024 / 4,096 / 16,384 accelerators (Llama 3 failure rate) from bench/results/*.json
	$(BIN)/python -m bench.goodput $(GOODPUT_ARGS)

bench: $(STAMP) ## benchmarks with side-by-side ratios -> bench/results/
	$(BIN)/python -m bench.run $(BENCH_ARGS)

bench-sharded: $(STAMP) ## sharded DTensor workload over 4 CPU ranks (issue 13) -> bench/results/sharded.json
	$(BIN)/python -m bench.sharded $(BENCH_ARGS)

READY_ARGS ?=
bench-ready: $(STAMP) ## sidecar time to ready beside a CPU-saturating trainer, vs idle and vs nice 19 (READY_ARGS) -> bench/results/ready.json
	$(BIN)/python -m bench.ready $(READY_ARGS)

ifeq ($(CHAOS_LONG),1)
CHAOS_ARGS ?= --crash-points 2000 --corruptions 1000 --seed 1 --max-seconds 3600
else
CHAOS_ARGS ?= --crash-points 200 --corruptions 200 --seed 1 --max-seconds 900
endif
chaos: $(STAMP) ## fault-injection campaign (not in make test; CHAOS_LONG=1: 2,000 crash points, 1,000 corruptions, 1 h cap); counts written after every cycle to bench/results/chaos.json
	$(BIN)/python -m tests.chaos.campaign $(CHAOS_ARGS) --out bench/results/chaos.json

dist: $(STAMP) ## build the wheel and sdist of strata-checkpoint into dist/ (no network: the venv's setuptools)
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
CHART_DIR ?= dist
HELM ?= $(shell bash e2e/build-tools.sh --print-dir)/helm

chart: ## package the Helm chart into $(CHART_DIR)/strata-<version>.tgz (version and appVersion = the package's; needs helm: make tools)
	@test -x "$(HELM)" || { echo "no helm at $(HELM): run 'make tools' (or set HELM)"; exit 1; }
	@mkdir -p $(CHART_DIR)
	$(HELM) lint --strict charts/strata --kube-version 1.29.0
	$(HELM) package charts/strata --destination $(CHART_DIR) --version $(VERSION) --app-version $(VERSION)
	@echo "push it to an OCI registry with: helm push $(CHART_DIR)/strata-$(VERSION).tgz oci://<registry>/<path>"

clean: ## remove .venv and caches (not the tool cache in ~/.cache/strata)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .strata-run
