"""The non-finite guard of every optimizer step, on both backends and every rank.

An optimizer step runs only when the loss this rank differentiated and the step's gradient norm (of the
whole model: every rank's pieces, `clip_grad_norm_` / `megatron.grads.clip_global_grad_norm`) are finite on
every rank; otherwise the gradients are dropped and AdamW's state is left as it was, as verl's actors do
(`if not torch.isfinite(grad_norm): optimizer.zero_grad()`). The ranks agree through one all-reduce of a
flag: a loss that is not finite on one rank alone (its rows) skips the step on all of them, so the ranks'
shards never diverge. The driver counts such updates and neither syncs nor checkpoints a step that applied
none (runtime/loop.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("r3operator.trainer")


def finite_on_every_rank(loss: float, grad_norm: float) -> bool:
    """True when `loss` (this rank's) and `grad_norm` are finite here and on every other rank of the default
    process group (one MAX all-reduce of a flag when there is a group of more than one rank)."""
    ok = math.isfinite(loss) and math.isfinite(grad_norm)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return ok
    import torch

    # A CPU tensor where the group has gloo (the trainer's ranks: cpu:gloo,cuda:nccl), else the rank's GPU.
    device = "cpu" if "gloo" in str(dist.get_backend()) else f"cuda:{torch.cuda.current_device()}"
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item()) == 0.0


def step_or_skip(optimizer: Any, loss: float, grad_norm: float, *, what: str) -> bool:
    """`optimizer.step()` when the guard passes (True); else drop the gradients, leave the optimizer's state
    untouched and log why (False)."""
    if finite_on_every_rank(loss, grad_norm):
        optimizer.step()
        return True
    optimizer.zero_grad(set_to_none=True)
    log.warning("%s: optimizer step skipped, loss %s / gradient norm %s not finite on some rank", what, loss, grad_norm)
    return False
