#!/usr/bin/env bash
# The GPU acceptance run (benchmarks/gpu_accept.py): one command after scripts/gpu-setup.sh, from the repo root.
#
#   bash scripts/gpu-accept.sh OUT --part 1        # ~9 min on 2 GPUs: main job, FSDP ranks, up on 2 GPUs
#   bash scripts/gpu-accept.sh OUT --part 2        # ~9 min: Megatron over ranks, weight sync + bandwidth
#   bash scripts/gpu-accept.sh OUT --part 3        # then, if device time is left: a3b, upgrade canary, …
#   bash scripts/gpu-accept.sh OUT --rows main_job # one row again
#   ACCEPT_DRY=1 bash scripts/gpu-accept.sh OUT    # anywhere: the commands, every row "not run"
#
# Writes OUT/accept.json, OUT/accept.md (rows of earlier invocations into the same OUT are kept) and
# OUT/logs-<part>.tar.gz. ACCEPT_BUDGET_S (default 540) caps one invocation: a row whose estimate no longer
# fits is recorded "not run" with that reason. Exit code 1 when a row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=python3
if [ "${ACCEPT_DRY:-0}" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
# What gpu-setup.sh installed (--target), vLLM's settings, the model cache: scripts/gpu-env.sh.
exec bash scripts/gpu-env.sh "$py" -m benchmarks.gpu_accept "$@"
