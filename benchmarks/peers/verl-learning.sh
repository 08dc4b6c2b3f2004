#!/usr/bin/env bash
# verl 0.9.1 beside r3operator at the learning workload (benchmarks/peers/verl_learning.py) on a lent GPU machine, run
# detached so that it outlives the device call that starts it (docs/benchmarks.md, "Against verl"). After
# scripts/gpu-setup.sh (r3operator's wheels into /tmp/site) and `benchmarks/peers/verl-setup.sh STASH --skip-te`
# (verl's into /tmp/verl-site):
#   1. beside each other: Transformer Engine's torch extension builds (verl-setup.sh, CPU only) while the learning
#      benchmark makes its data and warm start on the GPU (skipped when LEARN already holds warm/warm.json);
#   2. once both have ended: the comparison's parts, one after another, each on all GPUS GPUs.
#
#   bash benchmarks/peers/verl-learning.sh start GPUS STEPS   # e.g. `start 1 30`, `start 4 50`
#   bash benchmarks/peers/verl-learning.sh collect OUT        # logs, metrics, summary so far, and progress
#
# PARTS (default: every part, verl_learning's order) picks the comparison's parts, R3_MODES (default R3,Disabled) the
# modes of its `r3` part; WARM_OPTS the warm start's options (default those of the 2026-12-06 learning run: SFT batch
# 32, at most 800 steps, held-out reward target 0.2).
set -uo pipefail
cd "$(dirname "$0")/../.."
# VLEARN_ROOT and VERL_SETUP move the folders and the TE build elsewhere (tests/benchmarks/test_verl_learning.py).
root=${VLEARN_ROOT:-/root}
verl_setup=${VERL_SETUP:-benchmarks/peers/verl-setup.sh}
bg=$root/vlearn-bg
learn=$root/learn
out=$root/vlearn

case "${1:-}" in
start)
  gpus=${2:?GPUS} steps=${3:?STEPS}
  parts=${PARTS:-prepare,verl-R3,r3,verl-Disabled,summary}
  warm_opts=${WARM_OPTS:---warm-batch 32 --warm-max-steps 800}
  mkdir -p "$bg" "$out"
  rm -f "$bg"/*.rc  # an earlier start's: this chain waits for this start's
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
  setsid bash -c "bash $verl_setup $root/verl-stash > $bg/te.log 2>&1; echo \$? > $bg/te.rc" \
    < /dev/null > /dev/null 2>&1 &
  setsid bash -c "
    if [ ! -f $learn/warm/warm.json ]; then
      python3 -m benchmarks.learning --out $learn --parts data,warm --device cuda $warm_opts
    fi
    echo \$? > $bg/warm.rc
    while [ ! -f $bg/te.rc ]; do sleep 3; done
    python3 -m benchmarks.peers.verl_learning --learning-dir $learn --gpus $gpus --steps $steps --out $out \
      --parts $parts --r3-modes ${R3_MODES:-R3,Disabled}
    echo \$? > $bg/peer.rc" < /dev/null > "$bg/chain.log" 2>&1 &
  sleep 2
  echo "started: TE build beside the warm start ($learn), then $parts on $gpus GPU(s), $steps steps each, in $out"
  ;;
collect)
  dest=${2:?OUT}
  mkdir -p "$dest"
  for f in "$bg"/*; do [ -f "$f" ] && cp "$f" "$dest/"; done
  # What is read back only (no model, parquet or checkpoint), each file under 20 MB, packed within 60 s.
  (cd "$root" && find vlearn learn \( -name inputs -o -name checkpoints -o -name model -o -name data \) -prune \
    -o -type f \( -name '*.log' -o -name '*.csv' -o -name '*.json' -o -name '*.jsonl' -o -name '*.md' \
    -o -name '*.txt' -o -name '*.yaml' -o -name '*.png' \) -size -20M -print 2> /dev/null \
    | timeout 60 tar czf "$dest/vlearn.tgz" -T -)
  echo "== done: $(cd "$bg" && ls ./*.rc 2> /dev/null | tr '\n' ' ')"
  echo "== te"; tail -n 3 "$bg/te.log" 2> /dev/null
  echo "== chain"; grep -E '^(==|   |failed)' "$bg/chain.log" 2> /dev/null | tail -n 12
  for d in "$out"/verl-R3 "$out"/verl-Disabled; do
    [ -f "$d/console.log" ] && { echo "== $d"; grep -a "step:" "$d/console.log" | tail -n 1 | cut -c1-300; }
  done
  for log in "$out"/r3/logs/*.log "$out"/r3/log/console.log "$out"/r3/log-*/console.log; do
    [ -f "$log" ] && { echo "== $log"; tail -n 1 "$log" | cut -c1-300; }
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader 2> /dev/null
  ;;
*)
  echo "usage: verl-learning.sh start GPUS STEPS | collect OUT" >&2
  exit 2
  ;;
esac
