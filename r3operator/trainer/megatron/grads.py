"""Gradients of one Megatron step made whole before the optimizer sees them: the reductions megatron's
`DistributedDataParallel` + `finalize_model_grads` would do, written out for the local (no-DDP) model,
and the gradient norm of the whole model rather than of this rank's pieces.

Per parameter, after backward:

- sequence-parallel tagged weights (norms, routers under SP): each TP rank saw a part of the sequence,
  so their gradients are summed over the TP group (`norms.py` says which are tagged);
- dense parameters: summed over the data-parallel group, then divided by its size. Each data-parallel
  replica's loss is pre-weighted (`trainer/shards.py`: local tokens / mini-batch tokens × DP size), so the
  mean over replicas is the gradient of the whole mini-batch's token-mean loss;
- expert parameters (`local_experts`): every copy of an expert got the gradient of the tokens the
  dispatcher sent it, which may come from several data-parallel replicas (the expert-parallel group
  cuts across them) or from several TP ranks' sequence chunks (experts are not TP-sharded when
  expertTensorParallelSize is 1). Summed over the expert-data-parallel group (the copies) that is the
  sum over all replicas' losses, so it is divided by the data-parallel size too.

The norm then counts every element of the model once: TP-sharded tensors on every TP rank, replicated
ones on TP rank 0 only (likewise for experts over the expert-TP group), summed over the model-parallel
ranks that hold different pieces. It is the same number on every rank, so every rank clips alike.
"""

from __future__ import annotations

from typing import Any

# Any: Megatron-Core ships no type information: its models and gradient buffers are Any here.


def is_expert(name: str) -> bool:
    return "local_experts" in name


def _all_reduce(tensor: Any, group: Any) -> None:
    """Sum over `group`; nothing to do for a group of one."""
    import torch.distributed as dist

    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


def finalize_grads(model: Any) -> None:
    """Sum/average every gradient over the groups that share its parameter (see the module docstring)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if getattr(p, "sequence_parallel", False):
            _all_reduce(p.grad, ps.get_tensor_model_parallel_group())
        if is_expert(name):
            _all_reduce(p.grad, ps.get_expert_data_parallel_group())
        else:
            _all_reduce(p.grad, ps.get_data_parallel_group())
        if dp > 1:
            p.grad.div_(dp)


def _counts_once(name: str, p: Any) -> bool:
    """Whether this rank's copy of `p` is the one the norm counts (a TP shard always is)."""
    from megatron.core import parallel_state as ps

    if getattr(p, "tensor_model_parallel", False):
        return True
    rank = ps.get_expert_tensor_parallel_rank() if is_expert(name) else ps.get_tensor_model_parallel_rank()
    return rank == 0


def clip_global_grad_norm(model: Any, max_norm: float) -> float:
    """The L2 norm of the whole model's gradient (all ranks' pieces, each element once); scales every
    gradient by max_norm / norm when the norm exceeds it (as `torch.nn.utils.clip_grad_norm_`)."""
    import torch
    from megatron.core import parallel_state as ps

    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    device = params[0][1].grad.device if params else torch.device("cpu")
    dense = torch.zeros((), dtype=torch.float32, device=device)
    expert = torch.zeros((), dtype=torch.float32, device=device)
    for name, p in params:
        if _counts_once(name, p):
            sq = p.grad.detach().float().pow(2).sum()
            if is_expert(name):
                expert += sq
            else:
                dense += sq
    _all_reduce(dense, ps.get_tensor_model_parallel_group())
    _all_reduce(dense, ps.get_pipeline_model_parallel_group())
    _all_reduce(expert, ps.get_expert_tensor_model_pipeline_parallel_group())
    norm = (dense + expert).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _name, p in params:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return float(norm)
