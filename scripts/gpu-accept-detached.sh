#!/usr/bin/env bash
# scripts/gpu-accept.sh detached from the device call, so that rows run past one call's 10 minutes and beside the
# learning run (scripts/gpu-learning.sh): from a copy of the tree, in a session of its own (scripts/detached.sh),
# and every `wait` packs what it has so far, so a machine taken back mid-run still leaves the last call's files.
#
#   bash scripts/gpu-accept-detached.sh start [gpu-accept.sh args, e.g. --rows upgrade_vllm,main_job --beside …]
#   bash scripts/gpu-accept-detached.sh wait SECONDS OUT   # until it ends or SECONDS pass; OUT/accept.tgz
#
# `wait` exits 0 once the run has ended (its exit code in the log's last line), 3 while it still runs.
# ACCEPT_DETACHED_ROOT moves its folders (tests); ACCEPT_BUDGET_S passes through (default here 1500).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/detached.sh
root=${ACCEPT_DETACHED_ROOT:-/root}
copy=$root/accept-repo
out=$root/accept
log=$root/accept.log
work=${ACCEPT_WORK:-/tmp/r3-accept}

pack() {  # DEST: the record, the invocation's log, and every row's logs and small outputs so far
  mkdir -p "$1"
  { find "$out" "$log" -maxdepth 1 -type f 2>/dev/null
    find "$work" -maxdepth 6 -type f \( -name '*.log' -o -name '*.json' -o -name '*.csv' -o -name '*.md' \
      -o -name '*.yaml' \) -size -5M 2>/dev/null; } | tar -czf "$1/accept.tgz" -T - 2>/dev/null
}

case "${1:-}" in
  start)
    shift
    [ -f "$root/accept.pid" ] && kill -0 "$(cat "$root/accept.pid")" 2>/dev/null && {
      echo "an acceptance run is already going (pid $(cat "$root/accept.pid"))" >&2; exit 2; }
    rm -rf "$out" "$log" "$root/accept.rc"
    copy_tree "$copy"
    export ACCEPT_BUDGET_S=${ACCEPT_BUDGET_S:-1500}
    cd "$copy" || exit 1
    run_detached "$log" "$root/accept.rc" "$root/accept.pid" bash scripts/gpu-accept.sh "$out" "$@"
    echo "acceptance run started (pid $(cat "$root/accept.pid")): bash scripts/gpu-accept-detached.sh wait SECONDS OUT"
    ;;
  wait)
    seconds=${2:?wait SECONDS OUT}
    dest=${3:?wait SECONDS OUT}
    end=$((SECONDS + seconds))
    while [ ! -f "$root/accept.rc" ] && [ "$SECONDS" -lt "$end" ]; do sleep 2; done
    grep -E "^== |^   " "$log" 2>/dev/null | tail -n 12
    pack "$dest"
    if [ -f "$root/accept.rc" ]; then
      echo "ended: exit $(cat "$root/accept.rc")"
      exit 0
    fi
    echo "running"
    exit 3
    ;;
  *)
    echo "usage: bash scripts/gpu-accept-detached.sh start [gpu-accept.sh args] | wait SECONDS OUT" >&2
    exit 2
    ;;
esac
