"""How every benchmark hands back its result: JSON on stdout, and the same JSON in a file when asked for one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: Any, path: Path | None = None, *, echo: bool = True) -> None:
    """Print `result` as indented JSON (unless `echo` is off: the benchmark printed a table of its own) and, when
    `path` is given, write it there: its folder made, the file whole or not at all (a reader after a time-out
    kill, e.g. gpu_accept's judge, never sees half a file)."""
    text = json.dumps(result, indent=2)
    if echo:
        print(text, flush=True)
    if path is not None:
        write_json(path, result)


def write_json(path: Path, result: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(path)
