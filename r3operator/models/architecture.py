"""What `spec.model.architecture` states about a model, read from its Hugging Face config (a loaded
`PretrainedConfig` or anything with the same attributes)."""

from __future__ import annotations

from typing import Any


def num_experts(hf_config: Any) -> int | None:
    """Routed experts per MoE layer: `num_experts` (Qwen-MoE) or `num_local_experts` (Mixtral's name, which
    transformers 5 also writes for Qwen3-MoE); None for a dense model."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)


def architecture(hf_config: Any) -> dict[str, Any]:
    """`spec.model.architecture`'s numLayers, numExperts and topK as the config states them."""
    return {
        "numLayers": hf_config.num_hidden_layers,
        "numExperts": num_experts(hf_config),
        "topK": hf_config.num_experts_per_tok,
    }
