#!/usr/bin/env bash
# The learning run (benchmarks/learning.py) on a lent GPU machine, across calls: a call may last 10 minutes and the
# run takes ~25, so it runs detached (setsid) from a copy of the tree (each call re-sends the working tree) and later
# calls read its progress, then stop it and bring the figures back. After scripts/gpu-setup.sh:
#   bash scripts/gpu-learning.sh start [flags of benchmarks.learning]   # returns at once
#   bash scripts/gpu-learning.sh status [OUT]                           # steps and eval rewards per mode; OUT: the
#                                                                       # figures so far, OUT/learning.tgz
#   bash scripts/gpu-learning.sh collect OUT                            # stop it, summarise, OUT/learning.tgz
# `collect` writes the summary of whatever steps are done (benchmarks.learning --parts summary, with the start's
# flags), so a run the device budget cuts short still comes back whole. LEARNING_ROOT moves its folders (tests).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/detached.sh
root=${LEARNING_ROOT:-/root}
out=$root/learn
copy=$root/learn-repo
log=$root/learn.log

learning() {  # ARGS...: benchmarks.learning in the copy, in the GPU commands' environment
  (cd "$copy" && PYTHONUNBUFFERED=1 bash scripts/gpu-env.sh python3 -m benchmarks.learning --out "$out" "$@")
}

pack() {  # DEST: the figures so far (CSVs, logs, plots, JSONs), not checkpoints or models, into DEST/learning.tgz
  mkdir -p "$1"
  (cd "$out" && find . \( -name '*.csv' -o -name '*.json' -o -name '*.png' -o -name '*.yaml' -o -name '*.log' \
    -o -name 'report.md' \) -size -20M -not -path '*/checkpoints/*' -not -path '*/model/*' \
    | tar -czf "$1/learning.tgz" -T -)
}

stop() {  # the detached run's process group, then any run it started that left it (Ray workers stay with theirs)
  if [ -f "$root/learn.pid" ]; then
    kill -TERM -- "-$(cat "$root/learn.pid")" 2>/dev/null
    sleep 3
    kill -KILL -- "-$(cat "$root/learn.pid")" 2>/dev/null
  fi
  pkill -KILL -f "r3operator run $out/jobs/" 2>/dev/null
  return 0
}

case "${1:-}" in
  start)
    shift
    rm -rf "$out" "$root/learn.rc"
    copy_tree "$copy"
    printf '%s\n' "$@" > "$root/learn.args"
    export -f learning
    export out copy
    run_detached "$log" "$root/learn.rc" "$root/learn.pid" learning "$@"
    echo "learning run started (pid $(cat "$root/learn.pid")): bash scripts/gpu-learning.sh status"
    ;;
  status)
    for run in "$out"/runs/learning-*/; do
      [ -d "$run" ] || continue
      steps=0
      [ -f "$run/metrics.csv" ] && steps=$(($(wc -l < "$run/metrics.csv") - 1))
      evals=$(tail -n +2 "$run/eval.csv" 2>/dev/null | cut -d, -f1,3 | tr ',\n' '= ')
      echo "$(basename "$run"): $steps steps; held-out $evals"
    done
    grep -E "^== " "$log" 2>/dev/null | tail -n 8
    if [ -n "${2:-}" ] && [ -d "$out" ]; then pack "$2"; fi  # a machine taken back later still leaves these
    if [ -f "$root/learn.rc" ]; then echo "finished: exit $(cat "$root/learn.rc")"; else echo "running"; fi
    ;;
  collect)
    dest=${2:?collect OUT}
    stop
    mapfile -t args < "$root/learn.args"
    learning "${args[@]}" --parts summary > "$root/summary.log" 2>&1 || tail -n 20 "$root/summary.log"
    pack "$dest"
    cp "$out"/learning-*.json "$dest/" 2>/dev/null
    ls -l "$dest"
    ;;
  *)
    echo "usage: bash scripts/gpu-learning.sh start [flags] | status [OUT] | collect OUT" >&2
    exit 2
    ;;
esac
