"""MoE router families and which trainer backend can replay them.

The FSDP backend replays routes with forward hooks on transformers' ``*TopKRouter`` gates
(r3operator.trainer.replay.hf). Families whose router does not fit that contract (sigmoid scores
with a selection-only correction bias, grouped top-k, logits-only gate outputs) replay only on
Megatron, whose RouterReplay handles every score function.
"""

from __future__ import annotations

from r3operator.api.enums import RouterType

# transformers model_type -> the router class hooked by the HF replay.
HF_REPLAY_FAMILIES: dict[str, str] = {
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "olmoe": "OlmoeTopKRouter",
    "mixtral": "MixtralTopKRouter",
}

# Router types the HF hooks implement.
HF_REPLAY_ROUTER_TYPES: frozenset[RouterType] = frozenset({RouterType.SOFTMAX})
