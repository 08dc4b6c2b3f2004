"""FSDP2 (`torch.distributed.fsdp.fully_shard`) wrapping for the GPU trainer.

Each decoder layer is its own FSDP unit, then the root. World size 1 (one GPU, a process group of one)
is the in-process trainer's; `trainer/distributed.py` starts one rank per GPU (or CPU process) and
joins them with `init_rank` before the wrap.
Router replay hooks are installed on the wrapped model's router modules exactly as without FSDP: FSDP2
keeps module identities, so `find_routers` sees the same `*TopKRouter` modules.
"""

from __future__ import annotations

import os
import socket
from typing import Any

# Any: FSDP2's wrapped modules and optimizers, imported lazily: Any here.


def init_process_group_if_needed(device: str) -> tuple[int, int]:
    """Initialise torch.distributed (NCCL on CUDA, gloo on CPU) from env, defaulting to a group of one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A free port, not a fixed one: two one-process trainers on one host (two runs, a run next to a test)
    # would otherwise both listen on the same port and the second one fail with EADDRINUSE.
    os.environ.setdefault("MASTER_PORT", str(free_local_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend=process_group_backend(device))
    return dist.get_rank(), dist.get_world_size()


def free_local_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_group_backend(device: str) -> str:
    """NCCL for CUDA tensors plus gloo for CPU ones: the asynchronous checkpoint's planning collectives
    run on CPU tensors (DCP refuses a group without a CPU backend)."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def init_rank(*, rank: int, world_size: int, master_addr: str, master_port: int, device: str) -> None:
    """Join the trainer's process group as `rank` (rank 0 chose the address and port)."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
    )
    dist.init_process_group(
        backend=process_group_backend(device), rank=rank, world_size=world_size, timeout=timedelta(minutes=30)
    )


def wrap_fsdp2(model: Any, *, reshard_after_forward: bool = True, param_dtype: str = "float32") -> Any:
    """Shard every decoder layer, then the root. `param_dtype` bfloat16 = compute in bf16, fp32 master."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if param_dtype == "bfloat16" else torch.float32,
        reduce_dtype=torch.float32,
    )
    layers = model.model.layers if hasattr(model, "model") and hasattr(model.model, "layers") else []
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def full_state_dict(model: Any) -> dict[str, Any]:
    """Full (unsharded) model state dict on CPU, for weight sync and checkpoints."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state_dict(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: Any, optimizer: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )
