"""What a rendered engine container would exec, read without vLLM (not a test module): its command is run
with a `vllm` on PATH that prints its argv as JSON."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def exec_argv(argv: list[str], env: dict[str, str], tmp_path: Path) -> list[str]:
    """The argv `vllm` gets (after `vllm`) when ``argv`` runs with ``env``; a printing `vllm` first on PATH."""
    fake = tmp_path / "argv-printing-bin" / "vllm"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    path = os.pathsep.join([str(fake.parent), env.get("PATH", os.environ["PATH"])])
    out = subprocess.run(argv, env={**env, "PATH": path}, capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def flag(argv: list[str], name: str) -> str:
    """The value after ``name``."""
    return argv[argv.index(name) + 1]
