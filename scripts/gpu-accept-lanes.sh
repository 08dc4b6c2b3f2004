#!/usr/bin/env bash
# Rows of the acceptance run side by side, each lane on GPUs of its own, so a 4-GPU machine runs four 1-GPU
# rows (or two 2-GPU rows) in the wall time of one.
#
#   bash scripts/gpu-accept-lanes.sh OUT LANE [LANE ...]
#   LANE is ROWS (lane i runs on GPU i) or GPUS:ROWS, e.g.  OUT main_job upgrade_canary,megatron_replay
#                                                      or   OUT 0,1:up_2gpu,weight_sync 2,3:megatron_ranks_2gpu
#
# Each lane gets CUDA_VISIBLE_DEVICES=GPUS, ACCEPT_GPUS=<their count>, its own work, model-cache and Ray temp
# folders (two processes generating one reference model into one cache would race; two Ray drivers must not
# find each other's cluster), results in OUT/lane<i>/ (accept.json, accept.md, logs-*.tar.gz) and its console
# in /tmp/r3-accept-<OUT's name>-lane<i>.log. The work folder is named after OUT too
# (/tmp/r3-accept-<OUT's name>-lane<i>): a later invocation's lane i, run after this one, must not overwrite this
# one's benchmark JSONs, nor have its judges read them as its own (an IPC row beside an NCCL one). The model cache
# is by lane number only, so a later lane i reuses the models this one generated. Exit code 1 when a lane failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu-accept-lanes.sh OUT LANE [LANE ...]}
shift
[ $# -gt 0 ] || { echo "gpu-accept-lanes.sh: name the rows of at least one lane" >&2; exit 2; }
tag=$(basename "$out" | tr -c 'A-Za-z0-9_.\n-' '_')
pids=()
lane=0
for spec in "$@"; do
  if [[ $spec == *:* ]]; then gpus=${spec%%:*} rows=${spec#*:}; else gpus=$lane rows=$spec; fi
  count=$(tr ',' '\n' <<<"$gpus" | grep -c .)
  mkdir -p "$out/lane$lane" "/tmp/ray-lane$lane"
  CUDA_VISIBLE_DEVICES=$gpus ACCEPT_GPUS=$count ACCEPT_WORK=/tmp/r3-accept-$tag-lane$lane RAY_TMPDIR=/tmp/ray-lane$lane \
    R3OPERATOR_CACHE_DIR=${R3OPERATOR_CACHE_DIR:-/root/r3cache}-lane$lane \
    bash scripts/gpu-accept.sh "$out/lane$lane" --rows "$rows" > "/tmp/r3-accept-$tag-lane$lane.log" 2>&1 &
  pids+=($!)
  echo "lane $lane: GPUs $gpus: $rows"
  lane=$((lane + 1))
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for ((i = 0; i < lane; i++)); do echo "== lane $i"; tail -n 12 "/tmp/r3-accept-$tag-lane$i.log"; done
exit $rc
