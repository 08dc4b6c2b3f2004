#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-setup.sh: installs NIXL (vLLM's NixlConnector) into /tmp/site from the parts
# scripts/gpu-nixl-wheels.sh made. Run it in each call that carries .whl/nixl-00 or .whl/nixl-01: it keeps what it
# found in /root/nixl-stash and installs once both parts are there; afterwards it only checks `import nixl`.
set -euo pipefail
cd "$(dirname "$0")/.."
stash=/root/nixl-stash
mkdir -p "$stash"
cp .whl/nixl-0*/* "$stash"/ 2>/dev/null || true
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
drop_nixl_ep() {
  # nixl-cu13 also ships NIXL-EP (the MoE all-to-all), built for other torch releases than the image's 2.11
  # (no nixl_ep_cpp_torch211): vLLM's fused-MoE layer imports nixl_ep whenever it is found, so every MoE engine in
  # /tmp/site would fail to load. The KV connector needs only `nixl`.
  rm -rf /tmp/site/nixl_ep /tmp/site/nixl_ep_cu13
}
if python3 -c "import nixl_cu13, nixl" 2>/dev/null; then
  drop_nixl_ep
  echo "nixl: installed"
  exit 0
fi
if [ "$(ls "$stash"/nixl_cu13.whl.part.* 2>/dev/null | wc -l)" -lt 2 ] || [ ! -f "$stash/nixl.whl.part.00" ]; then
  echo "nixl: $(ls "$stash" | tr '\n' ' ')so far; carry the other part of .whl/nixl-0* and run this again"
  exit 0
fi
wheels=/root/nixl-wheels
mkdir -p "$wheels"
cat "$stash"/nixl_cu13.whl.part.* > "$wheels/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
cp "$stash/nixl.whl.part.00" "$wheels/nixl-1.5.1-py3-none-any.whl"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl
drop_nixl_ep
python3 -c "import nixl, nixl_cu13; print('nixl: installed', nixl.__file__)"
