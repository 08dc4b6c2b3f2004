"""The package layers stay import-light: the operator image never needs torch, vLLM or Ray.

Each check imports one layer in a fresh interpreter and lists which heavy modules got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "vllm", "ray", "megatron", "transformers", "kopf", "kubernetes")

# layer -> heavy modules it may load
ALLOWED: dict[str, set[str]] = {
    "r3operator.api": set(),
    "r3operator.routing": set(),
    "r3operator.cli.main": set(),
    "r3operator.operator.desired": set(),
    "r3operator.operator.handlers": {"kopf", "kubernetes"},
    "r3operator.engine.args": set(),
}


def _loaded_heavy(module: str) -> set[str]:
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_layer_imports_only_what_it_may(module: str) -> None:
    assert _loaded_heavy(module) <= ALLOWED[module]
