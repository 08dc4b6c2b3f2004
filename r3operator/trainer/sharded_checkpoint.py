"""One rank's side of a sharded, asynchronous checkpoint (`torch.distributed.checkpoint`, DCP).

Every rank writes its own shard of the model and of the AdamW state (`__<rank>_0.distcp`; rank 0 also
writes the global `.metadata`) plus its RNG state (`rng-rank<rank>.pt`). `save_async` returns once the
copy of the state into host memory is enqueued (`checkpoint_staging.py`: pinned buffers reused across
saves on CUDA); the copy and then the write run in background threads. Until the copy is done the live
tensors must not change: `guard(optimizer)` makes the optimizer's next step wait for it, so the copy
overlaps with the next step's rollout and forward passes, and every load waits for it too. The writer
thread talks to the other ranks on a gloo group of its own: its collectives must never interleave with
the training's on the default group.

Single-process trainers use the same path (DCP without a process group). A checkpoint is readable by
any number of ranks (DCP reshards on load), so a resume may change the world size.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.trainer.checkpoint_staging import SaveInFlight, new_stager, stager_is_reusable, start_save

# Any: torch's distributed-checkpoint state (modules, optimizers, DTensors), imported lazily: Any here.


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
    """At most one save in flight per rank; `wait` surfaces its error.

    `stager`: an `AsyncStager` for `dcp.async_save`; by default a `DefaultStager` chosen at the first save
    for the state's device (`checkpoint_staging.new_stager`), and again at every save where this torch's
    stager cannot stage twice (`checkpoint_staging.stager_is_reusable`)."""

    def __init__(self, *, stager: Any = None) -> None:
        import torch.distributed as dist

        self._stager = stager
        self._own_stager = stager is None
        self._in_flight: SaveInFlight | None = None
        # Created now, while every rank constructs its trainer in step: new_group is collective.
        self._group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None

    def guard(self, optimizer: Any) -> None:
        """Make every `optimizer.step()` wait until the save in flight has copied the live tensors."""
        optimizer.register_step_pre_hook(lambda _optimizer, _args, _kwargs: self.wait_staged())

    def save_async(self, directory: Path, state: dict[str, Any]) -> None:
        import torch

        # The stager reuses its host buffers: the previous save's writer must be done reading them.
        self.wait()
        directory.mkdir(parents=True, exist_ok=True)
        rng_file = directory / f"rng-rank{_rank():05d}.pt"
        torch.save(rng_state(), rng_file)
        fsync_file(rng_file)
        if self._own_stager and self._stager is not None and not stager_is_reusable():
            self._stager.close()  # its save is written (`wait` above); this torch cannot stage through it again
            self._stager = None
        if self._stager is None:
            self._stager = new_stager(state)
        self._in_flight = start_save(state, directory, stager=self._stager, process_group=self._group)

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the state out of the live tensors; raise its error."""
        if self._in_flight is not None:
            self._in_flight.staged.result()

    def wait(self) -> None:
        """Block until this rank's last save is on disk (DCP fsyncs its files); raise its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.written.result()

    def close(self) -> None:
        """Finish the save in flight, then release the stager's thread and host buffers."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def load(self, directory: Path, state: dict[str, Any]) -> None:
        """Fill `state` (a `policy_state` template) in place from `directory`; restore this rank's RNG if
        the checkpoint has one for it (a resume on more ranks than were saved has none for the new ones)."""
        import torch
        from torch.distributed.checkpoint.state_dict_loader import load

        self.wait()  # a save in flight still reads the live tensors that the load overwrites
        if not (directory / ".metadata").is_file():
            raise FileNotFoundError(f"{directory}: not a sharded checkpoint (no .metadata)")
        load(state, checkpoint_id=str(directory), process_group=self._group)
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
