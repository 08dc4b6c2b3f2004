"""One rank's side of a sharded, asynchronous checkpoint (`torch.distributed.checkpoint`, DCP).

Every rank writes its own shard of the model and of the AdamW state (`__<rank>_0.distcp`; rank 0 also
writes the global `.metadata`) plus its RNG state (`rng-rank<rank>.pt`). `save_async` returns once the
state is staged (copied into CPU memory), so the next step may change the live tensors at once; the
write runs in a background thread. That thread talks to the other ranks on a gloo group of its own: its
collectives must never interleave with the training's on the default group.

Single-process trainers use the same path (DCP without a process group). A checkpoint is readable by
any number of ranks (DCP reshards on load), so a resume may change the world size.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np


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


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def policy_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """{model, optimizer} as DCP wants them: FQN-keyed, sharded DTensors under FSDP2 (each rank its own
    shard), plain tensors otherwise. Creates AdamW's state if no step ran yet, so that a load has
    somewhere to put it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def load_policy_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class ShardedCheckpointer:
    """At most one save in flight per rank; `wait` surfaces its error."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._future: Any = None
        # Created now, while every rank constructs its trainer in step: new_group is collective.
        self._group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None

    def save_async(self, directory: Path, state: dict[str, Any]) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        self.wait()
        directory.mkdir(parents=True, exist_ok=True)
        rng_file = directory / f"rng-rank{_rank():05d}.pt"
        torch.save(rng_state(), rng_file)
        fsync_file(rng_file)
        self._future = dcp.async_save(state, checkpoint_id=str(directory), process_group=self._group)

    def wait(self) -> None:
        """Block until this rank's last save is on disk (DCP fsyncs its files); raise its error."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def load(self, directory: Path, state: dict[str, Any]) -> None:
        """Fill `state` (a `policy_state` template) in place from `directory`; restore this rank's RNG if
        the checkpoint has one for it (a resume on more ranks than were saved has none for the new ones)."""
        import torch
        import torch.distributed.checkpoint as dcp

        if not (directory / ".metadata").is_file():
            raise FileNotFoundError(f"{directory}: not a sharded checkpoint (no .metadata)")
        dcp.load(state, checkpoint_id=str(directory), process_group=self._group)
        rng_file = directory / f"rng-rank{_rank():05d}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))


def read_full_state(directory: Path) -> dict[str, Any]:
    """The whole checkpoint as one nested dict on CPU, without a template (single process): for trainers
    whose optimizer state cannot be pre-shaped (the Megatron adapter)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(directory), str(target))
        return torch.load(target, map_location="cpu", weights_only=False)
