#!/usr/bin/env bash
# A second vLLM release's install (scripts/gpu-wheels-release.sh parts, scripts/gpu-setup-release.sh), rehearsed on
# this CPU machine before device time is spent carrying it: the GPU machine's setup scripts run here, unchanged,
# over a stand-in of its image, and the same import check decides. A release whose server cannot import here will
# not import there either (the reverse is not promised: the stand-in is not the image).
#
#   bash scripts/rehearse-release.sh 0.33.0      # after scripts/gpu-wheels.sh and gpu-wheels-release.sh 0.33.0
#
# The stand-in (a Python 3.12 venv): the image's torch 2.11.0, torchvision 0.26.0 and transformers 5.17.0 from
# PyPI, with what they need. Step 1 installs 0.22.1's set with .whl/gpu-setup.sh and imports its server: that
# baseline passes on the GPU, so a failure there is the stand-in's, and the script stops before judging the release.
# Step 2 installs the release with scripts/gpu-setup-release.sh; its last line is the verdict. The setup scripts
# write /root/stash*, /root/joined-*, /tmp/site and /tmp/site-RELEASE as on the machine: run this where those are
# free (not on the GPU machine); they are removed when it ends. REHEARSE_ROOT (default /tmp/rehearse-RELEASE) keeps
# the venv and logs.
set -euo pipefail
cd "$(dirname "$0")/.."
release=${1:?usage: rehearse-release.sh RELEASE}
root=${REHEARSE_ROOT:-/tmp/rehearse-$release}
parts=.whl-$release
[ -d .whl ] && [ -d "$parts" ] || { echo "needs .whl (scripts/gpu-wheels.sh) and $parts (scripts/gpu-wheels-release.sh $release)" >&2; exit 2; }
for busy in /tmp/site "/tmp/site-$release" /root/stash "/root/stash-$release"; do
  [ ! -e "$busy" ] || { echo "$busy exists: the rehearsal installs there (remove it, or run elsewhere)" >&2; exit 2; }
done
# What the setup scripts write is this run's (it refused to start over any of it): gone again when it ends.
trap 'rm -rf /tmp/site "/tmp/site-$release" /root/stash "/root/stash-$release" /root/vllm-stash /root/extra \
  "/root/joined-$release" /root/vllm-0.22.1-*.whl /root/ray-*.whl' EXIT
mkdir -p "$root"
if [ ! -x "$root/venv/bin/python3" ]; then
  # pyenv's own 3.12 first: its `python3.12` shim fails where 3.12 is installed but not selected
  py312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
  [ -n "$py312" ] || py312=$(command -v python3.12 || true)
  [ -n "$py312" ] || { echo "needs a Python 3.12 (the GPU image's) for the stand-in" >&2; exit 2; }
  "$py312" -m venv "$root/venv"
  # torchvision as the image has it: a release that brings its own torch must bring a torchvision built for it.
  "$root/venv/bin/python3" -m pip install -q torch==2.11.0 torchvision==0.26.0 transformers==5.17.0
  # What the image has beyond them that 0.22.1's server imports: found by the baseline below, which passes on the GPU.
  "$root/venv/bin/python3" -m pip install -q --no-deps uvloop psutil aiohttp multidict attrs yarl propcache \
    aiohappyeyeballs aiosignal frozenlist cloudpickle py-cpuinfo tiktoken
fi
export PATH="$root/venv/bin:$PATH"  # the setup scripts' python3
echo "== the stand-in: $(python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)')"

mkdir -p /root/stash "/root/stash-$release"
cp .whl/part-*/* /root/stash/
echo "== 0.22.1's set (.whl/gpu-setup.sh), the baseline"
bash .whl/gpu-setup.sh /root/stash "$PWD" > "$root/setup-0.22.1.log" 2>&1 || { tail -n 20 "$root/setup-0.22.1.log"; exit 1; }
baseline="import vllm.entrypoints.openai.api_server, r3operator.engine.plugin, r3operator.engine.worker"
if ! PYTHONPATH=/tmp/site python3 -c "$baseline" > "$root/import-0.22.1.log" 2>&1; then
  tail -n 5 "$root/import-0.22.1.log"
  echo "the baseline does not import on the stand-in: the stand-in lacks what the image has; no verdict" >&2
  exit 1
fi
echo "   vLLM 0.22.1's server and r3operator's engine plugin import"

cp "$parts"/part-*/* "/root/stash-$release/"
echo "== $release (scripts/gpu-setup-release.sh)"
if bash scripts/gpu-setup-release.sh "$release" "/root/stash-$release" > "$root/setup-$release.log" 2>&1; then
  tail -n 1 "$root/setup-$release.log"
  echo "   vLLM $release's server imports over 0.22.1's set"
  # r3operator's vLLM plugin and worker extension, which the engines load, against the release's modules
  if ! PYTHONPATH="/tmp/site-$release:/tmp/site" python3 -c "import r3operator.engine.plugin, r3operator.engine.worker" \
      > "$root/plugin-$release.log" 2>&1; then
    grep -E "Error" "$root/plugin-$release.log" | tail -n 3
    echo "   r3operator's engine plugin does NOT import on vLLM $release (log: $root/plugin-$release.log)" >&2
    exit 1
  fi
  echo "   r3operator's engine plugin and worker extension import on it: carry it"
else
  grep -E "Error|error:" "$root/setup-$release.log" | tail -n 5
  echo "   vLLM $release does NOT import over 0.22.1's set (log: $root/setup-$release.log): add what it lacks to" \
    "scripts/gpu-wheels-release.sh before carrying it" >&2
  exit 1
fi
