#!/usr/bin/env bash
# One 4-GPU reservation for the verl comparison and acceptance rows at once, after scripts/gpu-setup.sh and
# `verl-setup.sh --skip-te` (docs/benchmarks.md, "Against verl / Commands on the GPU machine"):
#   GPUs 0,1, cores 0-15:   verl's inputs, then (once Transformer Engine's torch extension has built) verl with R3
#                           and with replay off, the table, then acceptance rows ROWS_A;
#   GPUs 2,3, cores 16-31:  r3operator's side (both replay modes through `r3operator up`, engine and trainer on a
#                           GPU each, then its fast settings: --r3-fast), the table, then acceptance rows ROWS_B;
#   cores 32-63:            the TE build (verl-setup.sh without --skip-te);
#   all four GPUs, when STEPS4 is given and both chains above have ended: verl with R3, then r3operator with R3,
#                           STEPS4 steps each on 4 GPUs (the same inputs), and their table.
# The two frameworks run at the same time on two GPUs each of the same host, each pinned to 16 cores. Every job
# runs detached (setsid), so it outlives the call that starts it; later calls run `collect`.
# VERL_PARTS (default verl-R3,verl-disabled) and R3_OPTS (default --r3-fast; add --skip-r3-disabled) choose the
# 2-GPU columns, so that a reservation short of time measures the R3 columns the target compares. R3_OPTS4 (default
# --skip-r3-disabled) is r3operator's options on four GPUs (add --r3-fast for the moonshot's column, ~5 min more).
# WARM_START_STEPS (default 0: the random-init model) warms the model both frameworks load by that many steps of
# r3operator's SFT warm-up in `prepare` (on GPU 0, lr WARM_START_LR, default the runner's); every part is told, and
# r3operator's lane waits for `prepare` before it starts.
#
#   bash benchmarks/peers/beside-accept.sh start STEPS ROWS_A ROWS_B [STEPS4]  # e.g. 20 sync_layouts_a3b up_2gpu 12
#   bash benchmarks/peers/beside-accept.sh four STEPS4 [ROWS_A ROWS_B]          # the 4-GPU comparison at once, then rows
#   bash benchmarks/peers/beside-accept.sh collect OUT                          # what is there so far, and progress
set -uo pipefail
cd "$(dirname "$0")/../.."
# BESIDE_ROOT, BESIDE_TMP and VERL_SETUP move the folders and the TE build elsewhere (tests/benchmarks/test_beside_accept.py).
root=${BESIDE_ROOT:-/root}
tmp=${BESIDE_TMP:-/tmp}
verl_setup=${VERL_SETUP:-benchmarks/peers/verl-setup.sh}
bg=$root/bg
peer=$root/peer
peer4=$root/peer4

rows_on() {  # GPUS NAME ROWS: acceptance rows on those GPUs, with work, cache and Ray folders of their own
  local gpus=$1 name=$2 rows=$3
  [ -n "$rows" ] || return 0
  mkdir -p "$tmp/ray-$name"
  CUDA_VISIBLE_DEVICES=$gpus ACCEPT_GPUS=2 ACCEPT_BUDGET_S=3000 ACCEPT_WORK=$tmp/r3-accept-$name \
    RAY_TMPDIR=$tmp/ray-$name R3OPERATOR_CACHE_DIR=$root/r3cache-$name \
    bash scripts/gpu-accept.sh "$root/accept-$name" --rows "$rows"
}

warm_opts() {  # the start every part is given (prepare makes it, the others check the inputs hold it)
  echo "--warm-start-steps ${WARM_START_STEPS:-0}${WARM_START_LR:+ --warm-start-lr $WARM_START_LR}"
}

compare() {  # GPUS STEPS OUT PART [OPTION…]: one part of the comparison on the GPUs this process was given
  local gpus=$1 steps=$2 out=$3
  shift 3
  # shellcheck disable=SC2046  # warm_opts's words are options, split on purpose
  python3 -m benchmarks.peers.verl_vs_r3 --gpus "$gpus" --steps "$steps" --out "$out" --timeout-s 900 $(warm_opts) \
    --parts "$@"
}

peer_part() { compare 2 "$steps" "$peer" "$@"; }  # PART [OPTION…] on two GPUs

four_chain() {  # STEPS4: verl, then r3operator, with R3 on all four GPUs, and their table
  local steps4=$1
  export CUDA_VISIBLE_DEVICES=0,1,2,3 RAY_TMPDIR=$tmp/ray-four
  mkdir -p "$RAY_TMPDIR"
  compare 4 "$steps4" "$peer4" verl-R3
  # shellcheck disable=SC2086  # R3_OPTS4's words are options, split on purpose
  compare 4 "$steps4" "$peer4" r3 ${R3_OPTS4:---skip-r3-disabled}
  compare 4 "$steps4" "$peer4" table
  echo done > "$bg/four.rc"
}

detach() {  # LOG COMMAND: run COMMAND (a bash script) detached from this call, so it outlives it
  local log=$1
  shift
  setsid bash -c "$1" < /dev/null > "$log" 2>&1 &
}

export_all() {  # what the detached chains call and read
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
  export -f rows_on warm_opts compare peer_part four_chain
  export WARM_START_STEPS=${WARM_START_STEPS:-0} WARM_START_LR=${WARM_START_LR:-} R3_OPTS4=${R3_OPTS4:-}
  export bg peer peer4 root tmp
  detach /dev/null "taskset -c 32-63 env MAX_JOBS=32 bash $verl_setup $root/verl-stash > $bg/te.log 2>&1
    echo \$? > $bg/te.rc"  # the TE build, beside everything else
}

case "${1:-}" in
start)
  steps=${2:?STEPS} rows_a=${3:-} rows_b=${4:-} steps4=${5:-}
  verl_parts=${VERL_PARTS:-verl-R3,verl-disabled} r3_opts=${R3_OPTS:---r3-fast}
  mkdir -p "$bg" "$peer"
  rm -f "$bg/prepare.rc"  # an earlier start's: r3operator's lane must wait for this start's prepare
  export steps
  export_all
  detach "$bg/chain-A.log" "export CUDA_VISIBLE_DEVICES=0,1 RAY_TMPDIR=$tmp/ray-verl; mkdir -p \$RAY_TMPDIR
    taskset -c 0-15 bash -c '
    peer_part prepare; echo \$? > $bg/prepare.rc
    while [ ! -f $bg/te.rc ]; do sleep 3; done
    for part in ${verl_parts//,/ }; do peer_part \$part; done; peer_part table; echo done > $bg/verl.rc
    rows_on 0,1 A \"$rows_a\"; echo done > $bg/rows-A.rc'"
  detach "$bg/chain-B.log" "export CUDA_VISIBLE_DEVICES=2,3 RAY_TMPDIR=$tmp/ray-r3; mkdir -p \$RAY_TMPDIR
    taskset -c 16-31 bash -c '
    if [ \"\$WARM_START_STEPS\" != 0 ]; then while [ ! -f $bg/prepare.rc ]; do sleep 3; done; fi
    peer_part r3 $r3_opts; peer_part table; echo done > $bg/r3.rc
    rows_on 2,3 B \"$rows_b\"; echo done > $bg/rows-B.rc'"
  if [ -n "$steps4" ]; then
    detach "$bg/chain-4.log" "taskset -c 0-31 bash -c '
      while [ ! -f $bg/rows-A.rc ] || [ ! -f $bg/rows-B.rc ]; do sleep 3; done
      mkdir -p $peer4 && cp -r $peer/inputs $peer4/
      four_chain $steps4'"
  fi
  sleep 2
  echo "started: TE build; GPUs 0,1: $verl_parts then rows '$rows_a'; GPUs 2,3: r3operator ($r3_opts) then rows" \
    "'$rows_b'; $steps steps; 4 GPUs after both: ${steps4:-not run} steps; start: ${WARM_START_STEPS} SFT steps"
  ;;
four)
  steps4=${2:?STEPS4} rows_a=${3:-} rows_b=${4:-}
  mkdir -p "$bg" "$peer4"
  rm -f "$bg/four.rc"  # an earlier run's: the rows must wait for this comparison
  export_all
  detach "$bg/chain-4.log" "taskset -c 0-31 bash -c '
    CUDA_VISIBLE_DEVICES=0,1,2,3 compare 4 $steps4 $peer4 prepare
    while [ ! -f $bg/te.rc ]; do sleep 3; done
    four_chain $steps4'"
  # Then acceptance rows on two GPUs each, at the same time: nothing else on the GPUs while the comparison runs.
  detach "$bg/chain-A.log" "while [ ! -f $bg/four.rc ]; do sleep 3; done
    taskset -c 0-15 bash -c 'rows_on 0,1 A \"$rows_a\"'; echo done > $bg/rows-A.rc"
  detach "$bg/chain-B.log" "while [ ! -f $bg/four.rc ]; do sleep 3; done
    taskset -c 16-31 bash -c 'rows_on 2,3 B \"$rows_b\"'; echo done > $bg/rows-B.rc"
  sleep 2
  echo "started: TE build; GPUs 0-3: verl with R3, then r3operator with R3, $steps4 steps each; then rows" \
    "'$rows_a' on GPUs 0,1 and '$rows_b' on GPUs 2,3"
  ;;
collect)
  out=${2:?OUT}
  mkdir -p "$out"
  for f in "$bg"/*; do [ -f "$f" ] && cp "$f" "$out/"; done
  # Only what is read back (logs, metrics, JSON, tables) and no file over 20 MB: a run folder holds model copies
  # and checkpoints of many GB, and a poll that packs them outlives its call and the machine's idle release.
  small() {  # DIR TGZ
    [ -d "$1" ] || return 0
    (cd "$1" && find . \( -name inputs -o -name checkpoints -o -name 'models' \) -prune -o -type f \
      \( -name '*.log' -o -name '*.csv' -o -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.txt' \
      -o -name '*.yaml' -o -name '*.tar.gz' \) -size -20M -print | timeout 60 tar czf "$2" -T -)
  }
  for lane in A B; do
    small "$root/accept-$lane" "$out/accept-$lane.tgz"
    small "$tmp/r3-accept-$lane" "$out/work-$lane.tgz"
  done
  small "$peer" "$out/peer.tgz"
  [ -f "$peer/inputs/warm_start.json" ] && cp "$peer/inputs/warm_start.json" "$out/"  # the inputs are pruned above
  small "$peer4" "$out/peer4.tgz"
  echo "== done: $(cd "$bg" && ls ./*.rc 2>/dev/null | tr '\n' ' ')"
  echo "== te";      tail -n 3 "$bg/te.log" 2>/dev/null
  for lane in A B 4; do echo "== chain $lane"; grep -E '^(==|   |failed)' "$bg/chain-$lane.log" 2>/dev/null | tail -n 8; done
  for d in "$peer"/verl-R3 "$peer"/verl-disabled "$peer4"/verl-R3; do
    [ -f "$d/console.log" ] && { echo "== $d"; grep -a "step:" "$d/console.log" | tail -n 1 | cut -c1-300; }
  done
  for d in "$peer"/r3/log-* "$peer4"/r3/log-*; do
    [ -f "$d/console.log" ] && { echo "== $d"; grep -a "^step" "$d/console.log" | tail -n 1 | cut -c1-300; }
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  ;;
*)
  echo "usage: beside-accept.sh start STEPS ROWS_A ROWS_B [STEPS4] | four STEPS4 [ROWS_A ROWS_B] | collect OUT" >&2
  exit 2
  ;;
esac
