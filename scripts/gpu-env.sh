#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-setup.sh: run COMMAND in the environment the project's GPU commands need
# (what gpu-setup.sh installed with --target on the path, vLLM's in-process engine core, no network, one model cache).
#
#   bash scripts/gpu-env.sh python3 -m benchmarks.learning --out /root/learn --device cuda
set -euo pipefail
cd "$(dirname "$0")/.."
site=${R3_SITE:-/tmp/site}
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 R3OPERATOR_CACHE_DIR=${R3OPERATOR_CACHE_DIR:-/root/r3cache}
exec "$@"
