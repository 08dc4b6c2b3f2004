#!/usr/bin/env bash
# Prepares .whl-verl/part-NN for the offline GPU machine: verl 0.9.1 and what it needs beyond the GPU image
# (Python 3.12, torch 2.11.0+cu130, transformers 5.17) and beyond r3operator's own GPU set (scripts/gpu-wheels.sh:
# vLLM 0.22.1 and its wheels, ray 2.60, megatron-core 0.19.2, pydantic, …), as manylinux cp312 wheels, repacked so
# that every part stays ≤ 48 MiB (each device transfer carries one part AND the working tree under 64 MiB).
#
#   bash scripts/gpu-wheels.sh                  # r3operator's set first (.whl/part-NN): verl runs on the same vLLM
#   bash benchmarks/peers/verl-wheels.sh        # then this: .whl-verl/part-NN + verl-setup.sh
#
# One vLLM release for both frameworks: 0.22.1. verl 0.9.1 imports any vLLM ≥ 0.18 and gates R3
# (`rollout.enable_rollout_routing_replay`) on vLLM ≥ 0.22.0 (verl/workers/rollout/vllm_rollout/vllm_async_server.py);
# 0.22.1 has `enable_return_routed_experts` and `CompletionOutput.routed_experts`, which that path reads. Its `vllm`
# extra's pins (vLLM 0.24.0, transformers 5.9.0) are therefore not followed for vLLM.
# transformers: verl 0.9.1 requires >=5.5.3,<5.11 (not 5.6.0); the image has 5.17, so transformers 5.9.0 (the pin of
# verl's extra, which vLLM 0.22.1 also accepts: >=4.56, not 5.0-5.5.0) goes into verl's own site dir only; r3operator
# keeps the image's 5.17. verl's R3 path is its Megatron engine (megatron-core's TopKRouter patched by
# verl/utils/megatron/router_replay_patch.py), built through mbridge with Transformer Engine layer specs: TE's core
# library comes as a wheel, its torch extension (transformer-engine-torch) only as a source archive, built on the
# GPU machine by verl-setup.sh (the one step of unknown length: see docs/benchmarks.md, "Against verl").
# The learning workload (benchmarks/peers/verl_learning.py) needs nothing more: its reward is r3operator's own code
# (pydantic, numpy: the image and r3operator's set), its parquet and plots the image's pyarrow and matplotlib; the pins
# below meet verl 0.9.1's Requires-Dist (tests/benchmarks/test_verl_learning.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.whl-verl}
mkdir -p "$out/all"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
# verl's own Requires-Dist (unzip -p verl-0.9.1-*.whl '*/METADATA'), less what the image or r3operator's set has
# (numpy, accelerate, packaging, dill, ray, torch, pydantic, fastapi, uvicorn, cachetools, pyzmq, msgspec), plus
# their needs that are not on the image either. wandb/tensorboard are imported only for those loggers (we log to
# console + file). flash-attn is left out (no wheel for torch 2.11 + CUDA 13): verl's FSDP engine imports it for
# remove-padding, and its Megatron engine needs it only with its default `attention_backend: flash`, which
# verl_config.py replaces with `fused` (Transformer Engine's cuDNN attention; te_preflight.py checks it on the GPU).
# transformers 5.9.0 wants tokenizers <= 0.23.0; tensordict 0.10 imports pyvers; verl 0.9.1's main_ppo imports
# transfer_queue (transferqueue) on every run (all three found missing on the GPU machine, 2026-11-27).
pkgs=(verl==0.9.1 transformers==5.9.0 tokenizers==0.22.2 pyvers==0.2.3 transferqueue==0.1.11 huggingface-hub==1.33.0
  hydra-core==1.3.2 omegaconf==2.3.0 codetiming tensordict==0.10.0 torchdata
  pybind11 pylatexenc peft datasets pyarrow pandas pytz tzdata xxhash multiprocess fsspec orjson
  mbridge==0.15.1 einops transformer-engine-cu13==2.20.2 transformer-engine==2.20.2 nvtx
  aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl attrs)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/all" "$p" 2>&1 | grep -v WARNING || true
done
# transformer-engine-torch has no binary wheel on PyPI: its source archive, built on the machine (verl-setup.sh).
# `pip download` would build its metadata, which needs torch here; the archive comes from the simple index instead,
# checked against the sha256 the index lists.
python3 - "$out/all" transformer-engine-torch 2.20.2 <<'PY'
import hashlib, re, sys, urllib.request
dest, name, version = sys.argv[1:]
page = urllib.request.urlopen(f"https://pypi.org/simple/{name}/", timeout=60).read().decode()
want = f"{name.replace('-', '_')}-{version}.tar.gz"
match = re.search(r'href="([^"#]*/' + re.escape(want) + r')#sha256=([0-9a-f]{64})"', page)
if match is None:
    sys.exit(f"{want}: not on the index")
data = urllib.request.urlopen(match.group(1), timeout=300).read()
if hashlib.sha256(data).hexdigest() != match.group(2):
    sys.exit(f"{want}: sha256 differs from the index's")
open(f"{dest}/{want}", "wb").write(data)
PY
# omegaconf 2.3 needs antlr4 4.9.*, published as a source archive only (pure Python): built into a wheel here.
python3 -m pip wheel -q --no-deps -w "$out/all" antlr4-python3-runtime==4.9.3 2>&1 | grep -v WARNING || true
# Files over 46 MiB are cut into NAME.part.NN (joined on the machine by verl-setup.sh); then everything is packed
# first-fit into parts of ≤ 48 MiB by r3operator's own repacker.
for f in "$out"/all/*; do
  if [ "$(stat -c %s "$f")" -gt $((46 * 2**20)) ]; then
    ( cd "$out/all" && split -b 46M -d "$(basename "$f")" "$(basename "$f").part." && rm "$(basename "$f")" )
  fi
done
mkdir -p "$out/part-00"
mv "$out"/all/* "$out/part-00/" && rmdir "$out/all"
python3 scripts/gpu-wheel-parts.py "$out" --max-mib 48
du -sh "$out"/part-*
echo "$(ls -d "$out"/part-* | wc -l) parts for verl (one device call each; see docs/benchmarks.md, Against verl)"
