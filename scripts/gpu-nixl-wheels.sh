#!/usr/bin/env bash
# Prepares .whl/nixl-00 and .whl/nixl-01 for the offline GPU machine: NIXL for vLLM's NixlConnector (the `pd_nixl`
# row of scripts/gpu-accept.sh), the `nixl` package vLLM imports and its CUDA 13 backend `nixl-cu13` (56 MiB,
# byte-split in two), each part <= 48 MiB so that it travels with the working tree under the device's 64 MiB.
#   bash scripts/gpu-nixl-wheels.sh      then carry .whl/nixl-00, then .whl/nixl-01, running
#   bash scripts/gpu-nixl-setup.sh on the machine after each (it installs once both parts are there)
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.5.1
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64)
all=.whl/nixl-all
rm -rf "$all" .whl/nixl-00 .whl/nixl-01 && mkdir -p "$all" .whl/nixl-00 .whl/nixl-01
python3 -m pip download -q --no-deps "${plat[@]}" -d "$all" "nixl==$version" "nixl-cu13==$version"
( cd "$all" && split -b 40M -d nixl_cu13-"$version"-*.whl nixl_cu13.whl.part. && rm nixl_cu13-"$version"-*.whl )
# The small `nixl` wheel rides as a byte part too: gpu-setup.sh moves every *.whl of its stash to vLLM's.
mv "$all"/nixl-"$version"-py3-none-any.whl "$all/nixl.whl.part.00"
mv "$all/nixl_cu13.whl.part.00" "$all/nixl.whl.part.00" .whl/nixl-00/
mv "$all/nixl_cu13.whl.part.01" .whl/nixl-01/
rmdir "$all"
du -sh .whl/nixl-*
