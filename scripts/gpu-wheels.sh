#!/usr/bin/env bash
# Prepares .whl/part-NN for the offline GPU machine: vLLM 0.22.1 and its wheels (from
# ../shared/gpu/vllm-wheels.sh), plus what the image lacks for r3operator (typer, rich, prometheus-client,
# matplotlib, …) and ray 2.60 split in two, repacked so that every part stays ≤ 48 MiB: each transfer carries one
# part AND the working tree under the device's 64 MiB limit.
#   bash scripts/gpu-wheels.sh      then send each .whl/part-NN, then scripts/gpu-setup.sh on the machine
set -euo pipefail
cd "$(dirname "$0")/.."
shared=../shared/gpu
mkdir -p .whl
cp "$shared/vllm-install.sh" "$shared/vllm-wheels.sh" scripts/gpu-setup.sh .whl/
[ -d .whl/part-00 ] || bash "$shared/vllm-wheels.sh" .whl
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_34_x86_64)
extra=.whl/extra && mkdir -p "$extra"
for p in typer==0.29.1 rich click shellingham markdown-it-py mdurl pygments pyyaml packaging prometheus-client \
         matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six typing-extensions \
         msgpack protobuf requests certifi charset-normalizer idna urllib3 filelock pydantic-settings python-dotenv; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$extra" "$p"
done
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl/ray ray==2.60.0
( cd .whl/ray && split -b 40M -d ray-2.60.0-*.whl ray.whl.part. && rm ray-2.60.0-*.whl )
# the small vLLM parts have room: extras into part-04, ray's halves into part-06 and a new part-07
mv "$extra"/* .whl/part-04/ && mv .whl/ray/ray.whl.part.00 .whl/part-06/
mkdir -p .whl/part-07 && mv .whl/ray/ray.whl.part.01 .whl/part-07/
rmdir "$extra" .whl/ray
python3 scripts/gpu-wheel-parts.py .whl --max-mib 48
du -sh .whl/part-*
