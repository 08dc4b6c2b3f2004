"""GPU memory as nvidia-smi reports it: every process on a GPU counted (an engine's, a trainer's, a peer
framework's workers), which torch in one process cannot see."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping


def nvidia_smi_memory_query(env: Mapping[str, str]) -> list[str]:
    """nvidia-smi ignores CUDA_VISIBLE_DEVICES: a run given some GPUs of a bigger machine (another job on the others)
    samples only its own, by physical index."""
    cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    visible = [g.strip() for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if visible and all(g.isdigit() for g in visible):
        cmd.append(f"--id={','.join(visible)}")
    return cmd


def used_mib(env: Mapping[str, str]) -> list[int]:
    """Memory in use on each of the GPUs `env` gives (all of them where it names none), MiB, in index order."""
    out = subprocess.run(nvidia_smi_memory_query(env), capture_output=True, text=True, check=False, timeout=30)
    used: dict[int, int] = {}
    for line in out.stdout.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            used[int(index)] = int(mib)
    return [used[i] for i in sorted(used)]
