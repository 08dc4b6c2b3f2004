#!/usr/bin/env bash
# On the GPU machine, after r3operator's own setup (scripts/gpu-setup.sh: vLLM 0.22.1, ray, megatron-core into
# /tmp/site) and after every .whl-verl/part-NN was copied into STASH (default /root/verl-stash):
# joins the byte-split pieces, installs verl 0.9.1 and its wheels into /tmp/verl-site (ahead of /tmp/site on verl's
# PYTHONPATH only, so r3operator keeps the image's transformers 5.17), then builds Transformer Engine's torch
# extension from its source archive (the slow step: MAX_JOBS cores, timed) unless it imports already.
#
#   bash benchmarks/peers/verl-setup.sh [STASH] [--skip-te]
set -euo pipefail
stash=${1:-/root/verl-stash}
site=/tmp/verl-site
mkdir -p "$site" /root/verl-joined
for first in "$stash"/*.part.00; do
  [ -e "$first" ] || continue
  name=$(basename "$first" .part.00)
  cat "$stash/$name".part.* > "/root/verl-joined/$name"
done
cp "$stash"/*.whl /root/verl-joined/ 2>/dev/null || true
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  /root/verl-joined/*.whl
echo "verl wheels installed in $((SECONDS - t0)) s"
export PYTHONPATH=$site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ "${2:-}" != "--skip-te" ] && ! python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
  sdist=$(ls "$stash"/transformer_engine_torch-*.tar.gz /root/verl-joined/transformer_engine_torch-*.tar.gz \
          2>/dev/null | head -1 || true)
  t0=$SECONDS
  # Built into a folder of its own, then merged: `pip --target` skips a package folder that exists already, and
  # the extension's files go into transformer_engine/, which the core wheel installed above.
  rm -rf /tmp/te-build
  NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-16} NVTE_CUDA_ARCHS=90 python3 -m pip install -q --no-index --no-deps \
    --no-build-isolation --no-cache-dir --target /tmp/te-build "$sdist"
  cp -r /tmp/te-build/. "$site/"
  echo "transformer-engine-torch built in $((SECONDS - t0)) s"
fi
python3 - <<'PY'
import importlib
for m in ("torch", "transformers", "vllm", "ray", "megatron.core", "transformer_engine.pytorch", "mbridge",
          "tensordict", "hydra", "verl", "verl.trainer.main_ppo", "verl.utils.megatron.router_replay_patch"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:42s} {getattr(mod, '__version__', 'ok')}")
    except Exception as exc:  # report every gap in one pass: the next session fills them all at once
        print(f"{m:42s} MISSING ({type(exc).__name__}: {exc})")
PY
