#!/usr/bin/env bash
# GPU measurements for docs/benchmarks.md, run on the lent GPU machine from the repo root after
# scripts/gpu-setup.sh installed vLLM 0.22.1 (+ ray, megatron-core 0.19.2) into /tmp/site.
#
#   bash scripts/gpu-bench.sh OUT_DIR [steps...]
#   steps: fidelity overhead megatron runtime ranks weightsync (default) | weightsync2 a3b a3b_ranks
#
# Each step writes OUT_DIR/<step>.log (+ .json); a failing step does not stop the others.
set -uo pipefail
out=${1:?usage: gpu-bench.sh OUT_DIR [steps...]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(fidelity overhead megatron runtime ranks weightsync)
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 R3OPERATOR_CACHE_DIR=${R3OPERATOR_CACHE_DIR:-/root/r3cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1

run() {  # name timeout cmd...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  tail -25 "$out/$name.log" >> "$out/summary.txt"
}

for step in "${steps[@]}"; do
  case $step in
    fidelity)
      run fidelity 300 python3 -m benchmarks.bench_fidelity --model gpu --device cuda --prompts 32 --max-tokens 96 \
        --variants bf16-sdpa-eager,fp32-sdpa-eager --json "$out/fidelity.json" ;;
    overhead)
      run overhead 150 python3 -m benchmarks.bench_replay_overhead --model gpu --device cuda --reps 10 ;;
    megatron)
      run megatron_tests 200 python3 -m pytest tests/gpu/test_megatron_replay.py -m gpu -q -p no:cacheprovider
      run megatron_bench 240 python3 -m benchmarks.bench_megatron --model gpu --device cuda --prompts 16 \
        --max-tokens 64 --trainer-dtype bfloat16 --json "$out/megatron.json" ;;
    runtime)
      run runtime 540 python3 -m r3operator run examples/rljob-local.yaml --model gpu --steps 5 --device cuda \
        --no-resume --compare-replay
      cp -r runs "$out/runs" 2>/dev/null || true ;;
    ranks)  # rank counts above the GPUs present are skipped and listed in the JSON
      run trainer_ranks 600 python3 -m benchmarks.bench_trainer_ranks --model gpu --device cuda --ranks 1 2 4 \
        --json "$out/trainer_ranks.json" ;;
    weightsync)  # 1 GPU: IPC vs the file path (+ a fault mid-sync); the NCCL test skips below 2 GPUs
      run weightsync_tests 330 python3 -m pytest tests/gpu/test_native_weight_sync.py -m gpu -q -p no:cacheprovider
      run weightsync_bench 240 python3 -m benchmarks.bench_weight_sync --model gpu --methods ipc,packed --syncs 5 \
        --log-dir "$out/weightsync" --json "$out/weightsync.json" ;;
    weightsync2)  # 2 GPUs: engine on GPU 1, trainer on GPU 0: NCCL vs the file path, next to raw NCCL broadcast
      run weightsync_nccl 600 python3 -m benchmarks.bench_weight_sync --model gpu --methods nccl,packed \
        --engine-gpu 1 --syncs 5 --log-dir "$out/weightsync2" --json "$out/weightsync2.json" ;;
    a3b)  # #14: the a3b model, 10 R3 steps on the JSONL math dataset read from a mounted path, FSDP on 1 GPU
      mkdir -p /tmp/pvc/datasets && cp examples/data/arith.jsonl /tmp/pvc/datasets/
      run a3b_run 560 python3 -m r3operator run benchmarks/jobs/a3b-math.yaml --device cuda --no-resume \
        --out-dir "$out/runs"
      rm -rf "$out"/runs/*/checkpoints ;;  # ~30 GB: the figures are in metrics.csv / report.md
    a3b_ranks)  # the trainer alone at the a3b shape through the Ray-actor path (1 rank per GPU present)
      run a3b_ranks 560 python3 -m benchmarks.bench_trainer_ranks --model a3b --device cuda --ranks 1 2 4 \
        --json "$out/a3b_ranks.json" ;;
    *) echo "unknown step $step" | tee -a "$out/summary.txt" ;;
  esac
done
