#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-setup.sh (vLLM 0.22.1 in /tmp/site) and every DIR/part-NN of
# scripts/gpu-wheels-release.sh RELEASE copied into STASH: installs that release into /tmp/site-RELEASE, its own site
# directory, so both releases run on one machine. Put it first: PYTHONPATH=/tmp/site-RELEASE:/tmp/site (what it
# lacks comes from 0.22.1's set) and PATH=/tmp/site-RELEASE/bin:/tmp/site/bin (its `vllm` wrapper).
#
#   bash scripts/gpu-setup-release.sh 0.26.0 /root/stash-0.26.0
set -euo pipefail
release=${1:?usage: gpu-setup-release.sh RELEASE [STASH]}
stash=${2:-/root/stash-$release}
site=/tmp/site-$release
mkdir -p "$site/bin" /root/joined-$release
rm -f "$site/.ready"  # benchmarks/upgrade_row.py --site-wait: the release is there once the import below passed
for parts in "$stash"/*.whl.part.00; do  # byte-split wheels, joined in their glob order
  [ -e "$parts" ] || continue
  whl=$(basename "${parts%.part.00}")
  cat "$stash/$whl".part.* > "/root/joined-$release/$whl"
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "/root/joined-$release"/*.whl \
  $(ls "$stash"/*.whl 2>/dev/null || true)
cat > "$site/bin/vllm" <<PY
#!$(command -v python3)
import os
import sys

sites = ["$site", "/tmp/site"]
sys.path[:0] = sites
os.environ["PYTHONPATH"] = os.pathsep.join([*sites, *filter(None, [os.environ.get("PYTHONPATH")])])
from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x "$site/bin/vllm"
PYTHONPATH="$site:/tmp/site" python3 -c "
import torch, vllm, vllm.entrypoints.openai.api_server  # the server's imports, as vllm serve makes them
print('vllm', vllm.__version__, 'torch', torch.__version__, 'from', vllm.__file__)"
touch "$site/.ready"
