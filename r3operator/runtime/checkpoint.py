"""Atomic step-boundary checkpoints: model + optimizer + step + RNG + policy version.

Layout under `<run dir>/checkpoints/` (cluster: the shared volume):

    step-000004/state.pt     torch.save of {model, optimizer, rng, extra}
    step-000004/meta.json    {"step", "policy_version", "format": 1}; written last inside the temp dir
    latest                   "step-000004\\n", replaced atomically after the rename

A checkpoint is written into `.tmp-step-000004-<random>/`, fsynced, then renamed into place: a reader
(a restarted driver) sees a complete checkpoint or none. `latest` is only a hint; `find_latest` falls
back to the newest complete `step-*` directory if `latest` is missing or points at a removed one.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
LATEST = "latest"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    policy_version: int


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    *,
    step: int,
    policy_version: int,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> CheckpointInfo:
    import torch

    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = root / f".tmp-{name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        state = {"model": model_state, "optimizer": optimizer_state, "rng": rng_state(), "extra": extra or {}}
        torch.save(state, tmp / "state.pt")
        _fsync_path(tmp / "state.pt")
        meta = {"format": FORMAT, "step": step, "policy_version": policy_version}
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
        _fsync_path(tmp / "meta.json")
        final = root / name
        if final.exists():  # a re-run of the same step after a crash between rename and `latest`
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = root / f".{LATEST}.tmp-{secrets.token_hex(4)}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / LATEST)
    _prune(root, keep_last=keep_last)
    return CheckpointInfo(final, step, policy_version)


def _complete(path: Path) -> CheckpointInfo | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT or not (path / "state.pt").is_file():
        return None
    return CheckpointInfo(path, int(meta["step"]), int(meta["policy_version"]))


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    if not root.is_dir():
        return []
    found = [_complete(p) for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def find_latest(root: Path) -> CheckpointInfo | None:
    hint = root / LATEST
    if hint.is_file():
        info = _complete(root / hint.read_text().strip())
        if info is not None:
            return info
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(info: CheckpointInfo) -> dict[str, Any]:
    import torch

    return torch.load(info.path / "state.pt", map_location="cpu", weights_only=False)


def _prune(root: Path, *, keep_last: int) -> None:
    for info in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(info.path, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
