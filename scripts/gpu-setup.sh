#!/bin/bash
# On the GPU machine, after every .whl/part-NN was copied into /root/stash:
# installs vLLM 0.22.1 (+ its wheels) into /tmp/site, then the extra wheels the image lacks
# (only those whose module does not import already, so the image's torch stack stays as is),
# then ray (joined from two parts), then r3operator itself (no deps), then the `vllm` and `r3operator`
# executables `r3operator up` runs, in /tmp/site/bin. Afterwards:
#   export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site
set -euo pipefail
stash=${1:-/root/stash}
repo=${2:-$PWD}
mkdir -p /root/vllm-stash /root/extra
mv "$stash"/vllm.whl.part.* /root/vllm-stash/ 2>/dev/null || true
# vllm-install.sh expects the vLLM parts and the dependency wheels in one folder.
for f in "$stash"/*.whl; do
  case "$(basename "$f")" in
    typer-*|rich-*|click-*|shellingham-*|markdown_it_py-*|mdurl-*|pygments-*|pyyaml-*|PyYAML-*|packaging-*|\
    prometheus_client-*|matplotlib-*|contourpy-*|cycler-*|fonttools-*|kiwisolver-*|pillow-*|pyparsing-*|\
    python_dateutil-*|six-*|typing_extensions-*|msgpack-*|protobuf-*|requests-*|certifi-*|charset_normalizer-*|\
    idna-*|urllib3-*|filelock-*|pydantic_settings-*|python_dotenv-*) mv "$f" /root/extra/ ;;
  esac
done
mv "$stash"/*.whl /root/vllm-stash/
bash "$repo/.whl/vllm-install.sh" /root/vllm-stash   # copied from ../shared/gpu by scripts/gpu-wheels.sh
export PYTHONPATH=/tmp/site
need=()
for f in /root/extra/*.whl; do
  name=$(basename "$f" | cut -d- -f1)
  mod=$(echo "$name" | tr 'A-Z' 'a-z')
  case "$mod" in
    pyyaml) mod=yaml ;; python_dateutil) mod=dateutil ;; markdown_it_py) mod=markdown_it ;;
    pillow) mod=PIL ;; python_dotenv) mod=dotenv ;; charset_normalizer) mod=charset_normalizer ;; protobuf) mod=google.protobuf ;;
  esac
  python3 -c "import $mod" 2>/dev/null || need+=("$f")
done
if [ ${#need[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${need[@]}"
fi
if ! python3 -c "import ray" 2>/dev/null && ls "$stash"/ray.whl.part.* >/dev/null 2>&1; then
  cat "$stash"/ray.whl.part.* > /root/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site "$repo" 2>&1 | tail -2 || true
# A --target install leaves its console scripts unusable (they need /tmp/site on the path, and no bin/ is on
# PATH): wrappers that put /tmp/site first on sys.path and PYTHONPATH (for the processes they start), then run
# the distribution's own entry point. The __main__ guard: vLLM's engine core re-imports its main script (spawn).
python3 - /tmp/site <<'PY'
import os
import sys
from importlib.metadata import distribution
from pathlib import Path

site = sys.argv[1]
sys.path.insert(0, site)
bin_dir = Path(site) / "bin"
bin_dir.mkdir(exist_ok=True)
for dist_name, script in (("vllm", "vllm"), ("r3operator", "r3operator")):
    try:
        [ep] = [e for e in distribution(dist_name).entry_points if e.group == "console_scripts" and e.name == script]
    except Exception as exc:  # report, don't stop: the version table below says what is missing
        print(f"no {script} executable: {type(exc).__name__}: {exc}")
        continue
    module, _, func = ep.value.partition(":")
    wrapper = bin_dir / script
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os\nimport sys\n\n"
        f"sys.path.insert(0, {site!r})\n"
        f"os.environ['PYTHONPATH'] = os.pathsep.join(p for p in ({site!r}, os.environ.get('PYTHONPATH')) if p)\n"
        f"from {module} import {func}\n\n"
        f"if __name__ == '__main__':\n    sys.exit({func}())\n"
    )
    wrapper.chmod(0o755)
    print(f"{script:14s} -> {wrapper} ({ep.value})")
PY
python3 - <<'PY'
import importlib
for m in ("torch", "transformers", "vllm", "ray", "megatron.core", "pydantic", "typer", "rich", "r3operator"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:14s} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # report, don't stop: the caller decides what it needs
        print(f"{m:14s} MISSING ({type(exc).__name__}: {exc})")
PY
echo "put the executables on PATH: export PATH=/tmp/site/bin:\$PATH PYTHONPATH=/tmp/site"
