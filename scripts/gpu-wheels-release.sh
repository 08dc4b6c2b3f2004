#!/usr/bin/env bash
# Prepares DIR/part-NN (default .whl-RELEASE) for a SECOND vLLM release on the offline GPU machine, beside the 0.22.1
# that scripts/gpu-wheels.sh brings: the vLLM wheel (byte-split) and only the packages whose pins differ from 0.22.1's
# set (read in the two wheels' metadata), every part <= 48 MiB (one part per device call, with the working tree).
# On the machine: scripts/gpu-setup-release.sh RELEASE /root/stash-RELEASE installs it into /tmp/site-RELEASE.
#
#   bash scripts/gpu-wheels-release.sh 0.26.0     # 0.26.0: the GPU image's torch 2.11.0; ~300 MB, 7 parts
#   bash scripts/gpu-wheels-release.sh 0.33.0     # 0.33.0: torch 2.14.0 and its CUDA libraries too; ~2.2 GB
set -euo pipefail
cd "$(dirname "$0")/.."
release=${1:?usage: gpu-wheels-release.sh RELEASE [DIR]}
dir=${2:-.whl-$release}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_18_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plat+=(--platform "$p")
done
case "$release" in
  0.26.0)
    # Its metadata against 0.22.1's: these pins moved (the image's torch 2.11.0 stays; FlashInfer stays out, as for
    # 0.22.1: VLLM_USE_FLASHINFER_SAMPLER=0). fastapi >= 0.133 and starlette >= 1.0.1 are its new floors.
    pkgs=(compressed-tensors==0.17.0 apache-tvm-ffi==0.1.10 nvtx==0.2.15 "fastapi>=0.133.0,<0.137.0"
      "starlette>=1.0.1" "prometheus-fastapi-instrumentator>=8.0.0") ;;
  0.33.0)
    # torch 2.14.0 (the image has 2.11.0) with the CUDA libraries whose pins moved (cuda-toolkit 13.0.3 against the
    # image's 13.0.2 is taken as compatible: not verified), FlashInfer, which 0.33 requires, and the moved pins.
    # scripts/rehearse-release.sh found what the metadata alone missed: huggingface_hub 2 imports httpx2 (not in
    # 0.22.1's set), and the server imports orjson. The H100 found torchvision: the image's 0.26.0 is built for
    # torch 2.11, fails to import under 2.14 ("operator torchvision::nms does not exist"), and the server imports it.
    pkgs=(torch==2.14.0 torchvision==0.29.2 "triton~=3.8.0" nvidia-cudnn-cu13==9.24.0.43 nvidia-nccl-cu13==2.30.7
      nvidia-cusparselt-cu13==0.8.1 flashinfer-python==0.7.2.post1 tilelang==0.1.12 apache-tvm-ffi==0.1.11
      compressed-tensors==0.17.0 nvtx==0.2.15 "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1"
      "prometheus-fastapi-instrumentator>=8.0.0" "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0,<2"
      "tokenizers>=0.23.2" "orjson>=3.11.6") ;;
  *) echo "gpu-wheels-release.sh: no package list for $release (add one from its wheel's Requires-Dist)" >&2; exit 2 ;;
esac
mkdir -p "$dir/all"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir/all" "vllm==$release"
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir/all" "$p"
done
( cd "$dir/all" && for w in *.whl; do [ "$(stat -c %s "$w")" -gt $((40 * 2**20)) ] || continue
    split -b 40M -d "$w" "$w.part." && rm "$w"; done )
mkdir -p "$dir/part-00" && mv "$dir"/all/* "$dir/part-00/" && rmdir "$dir/all"
python3 scripts/gpu-wheel-parts.py "$dir" --max-mib 48
du -sh "$dir" && ls -d "$dir"/part-* | wc -l
