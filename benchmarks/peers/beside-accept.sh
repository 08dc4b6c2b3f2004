#!/usr/bin/env bash
# One 4-GPU reservation for two jobs at once, after scripts/gpu-setup.sh and `verl-setup.sh --skip-te`:
#   GPUs 0,1 (cores 0-15):  the verl comparison: r3operator's run and verl's inputs first (no Transformer Engine needed), then verl
#                           R3 and replay off once TE's torch extension has built, then the table;
#   GPUs 2,3 (cores 16-31): acceptance rows (scripts/gpu-accept-lanes.sh);
#   cores 32-63:            the TE build (verl-setup.sh without --skip-te).
# Each job runs detached (setsid), so it outlives the call that starts it; later calls run `collect`.
#
#   bash benchmarks/peers/beside-accept.sh start ROWS STEPS   # e.g. sync_layouts,weight_sync 20
#   bash benchmarks/peers/beside-accept.sh collect OUT        # copies what is there so far into OUT, prints progress
set -uo pipefail
cd "$(dirname "$0")/../.."
bg=/root/bg
peer=/root/peer
accept=/root/accept
case "${1:-}" in
start)
  rows=${2:?rows for GPUs 2,3}
  steps=${3:-20}
  mkdir -p "$bg"
  export PATH=/tmp/site/bin:$PATH
  setsid bash -c "taskset -c 32-63 env MAX_JOBS=32 bash benchmarks/peers/verl-setup.sh /root/verl-stash \
    > $bg/te.log 2>&1; echo \$? > $bg/te.rc" < /dev/null > /dev/null 2>&1 &
  setsid bash -c "ACCEPT_BUDGET_S=3000 taskset -c 16-31 bash scripts/gpu-accept-lanes.sh $accept 2,3:$rows \
    > $bg/accept.log 2>&1; echo \$? > $bg/accept.rc" < /dev/null > /dev/null 2>&1 &
  setsid bash -c "export CUDA_VISIBLE_DEVICES=0,1 RAY_TMPDIR=/tmp/ray-peer PYTHONPATH=/tmp/site:$PWD
    mkdir -p /tmp/ray-peer
    peer() { taskset -c 0-15 python3 -m benchmarks.peers.verl_vs_r3 --gpus 2 --steps $steps --out $peer \
      --timeout-s 900 --parts \"\$1\"; }
    peer r3; peer prepare
    while [ ! -f $bg/te.rc ]; do sleep 5; done
    peer verl-R3; peer verl-disabled; peer table
    echo done > $bg/peer.rc" < /dev/null > "$bg/peer.log" 2>&1 &
  sleep 2
  echo "started: te, accept (GPUs 2,3: $rows), peer (GPUs 0,1, $steps steps)"
  ;;
collect)
  out=${2:?OUT}
  mkdir -p "$out"
  for f in "$bg"/*; do [ -f "$f" ] && cp "$f" "$out/"; done
  cp /tmp/r3-accept-lane0.log "$out/accept-lane.log" 2>/dev/null
  [ -d "$accept" ] && tar czf "$out/accept.tgz" -C "$accept" . 2>/dev/null
  [ -d "$peer" ] && tar czf "$out/peer.tgz" -C "$peer" --exclude=inputs --exclude=checkpoints . 2>/dev/null
  echo "== rc files: $(cd "$bg" && grep -H . ./*.rc 2>/dev/null | tr '\n' ' ')"
  echo "== te";     tail -n 5 "$bg/te.log" 2>/dev/null
  echo "== peer";   tail -n 8 "$bg/peer.log" 2>/dev/null
  for d in "$peer"/verl-R3 "$peer"/verl-disabled "$peer"/r3; do
    [ -f "$d/console.log" ] && { echo "== $d"; tail -n 6 "$d/console.log"; }
  done
  echo "== accept"; grep -E '^(==|   )' /tmp/r3-accept-lane0.log 2>/dev/null | tail -n 12
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
  ;;
*)
  echo "usage: beside-accept.sh start ROWS [STEPS] | collect OUT" >&2
  exit 2
  ;;
esac
