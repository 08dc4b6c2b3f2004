"""RMSNorm for the local (no Transformer Engine) layer spec under sequence parallelism.

megatron-core's local spec uses `WrappedTorchNorm`, which refuses `sequence_parallel` because a torch
norm does not tag its weight; and megatron refuses MoE + tensor parallelism *without* sequence
parallelism when training. Without Transformer Engine that leaves TP > 1 unusable for MoE, so this
module is the missing piece: the same `torch.nn.functional.rms_norm` math, with the weight tagged the way
megatron's own fused norms and routers tag theirs. A tagged weight's gradient is summed over the TP group
after backward (MegatronTrainer._allreduce_sequence_parallel_grads), because each TP rank's copy only
saw part of the data:

- input / pre-MLP / final norms see this rank's *sequence* shard (sequence parallel);
- q/k norms see the full sequence but only this rank's *heads* (tensor parallel), and their weight is
  shared across heads.
"""

from __future__ import annotations

from typing import Any

import torch


class TaggedRMSNorm(torch.nn.Module):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Megatron tags sequence-parallel parameters by attribute (its grad all-reduce reads the tag).
        tagged = bool(config.sequence_parallel and config.tensor_model_parallel_size > 1)
        self.weight.sequence_parallel = tagged  # type: ignore[attr-defined]  # Megatron's own attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def use_tagged_norms(block_spec: Any) -> Any:
    """Swap every norm of a local GPT decoder-block spec for `TaggedRMSNorm` (in place; returns it)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(holder: Any, name: str) -> None:
        if getattr(holder, name, None) is WrappedTorchNorm:
            setattr(holder, name, TaggedRMSNorm)

    for layer in block_spec.layer_specs:
        sub = layer.submodules
        swap(sub, "input_layernorm")
        swap(sub, "pre_mlp_layernorm")
        attention = getattr(getattr(sub, "self_attention", None), "submodules", None)
        if attention is not None:
            swap(attention, "q_layernorm")
            swap(attention, "k_layernorm")
    swap(block_spec, "layer_norm")
    return block_spec
