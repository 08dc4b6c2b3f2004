#!/usr/bin/env bash
# One-GPU rows of the acceptance run side by side: lane i runs its rows on GPU i alone, so a 2-GPU machine
# does two 1-GPU rows in the wall time of one.
#
#   bash scripts/gpu-accept-lanes.sh OUT ROWS_GPU0 [ROWS_GPU1 ...]    e.g. OUT main_job upgrade_canary,megatron_replay
#
# Lane i: CUDA_VISIBLE_DEVICES=i, ACCEPT_GPUS=1, its own work and model-cache folders (two processes that
# generate the same reference model into one cache would race), results in OUT/lane<i>/ (accept.json,
# accept.md, logs-*.tar.gz), its console in /tmp/r3-accept-lane<i>.log. Put lanes whose rows start Ray
# in-process on at most one lane: two drivers on one machine could join each other's Ray cluster.
# Exit code 1 when a lane failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu-accept-lanes.sh OUT ROWS_GPU0 [ROWS_GPU1 ...]}
shift
[ $# -gt 0 ] || { echo "gpu-accept-lanes.sh: name the rows of at least one lane" >&2; exit 2; }
pids=()
lane=0
for rows in "$@"; do
  mkdir -p "$out/lane$lane"
  CUDA_VISIBLE_DEVICES=$lane ACCEPT_GPUS=1 ACCEPT_WORK=/tmp/r3-accept-lane$lane \
    R3OPERATOR_CACHE_DIR=${R3OPERATOR_CACHE_DIR:-/root/r3cache}-lane$lane \
    bash scripts/gpu-accept.sh "$out/lane$lane" --rows "$rows" > "/tmp/r3-accept-lane$lane.log" 2>&1 &
  pids+=($!)
  lane=$((lane + 1))
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for ((i = 0; i < lane; i++)); do echo "== lane $i"; tail -n 12 "/tmp/r3-accept-lane$i.log"; done
exit $rc
