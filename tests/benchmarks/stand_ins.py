"""The GPU machine's scripts run on CPU with the programs they start replaced by stand-ins: bash scripts put first on
PATH, so that a test drives the real script and reads what the stand-ins recorded or wrote."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def env_with_stand_ins(tmp_path: Path, programs: Mapping[str, str], **variables: str) -> dict[str, str]:
    """This process's environment with each of `programs` (name → bash script text) executable in tmp_path/bin,
    first on PATH, and `variables` set."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in programs.items():
        program = bin_dir / name
        program.write_text(text)
        program.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **variables}
