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


def moe_layers(hf_config: Any) -> tuple[int, ...]:
    """The decoder layers that route to experts, as the transformers model of the config builds them: all but
    `mlp_only_layers` and those off `decoder_sparse_step` (Qwen-MoE families), those from
    `first_k_dense_replace` on every `moe_layer_freq` (DeepSeek, GLM-4-MoE), every layer otherwise (Mixtral,
    OLMoE). Empty for a dense model."""
    if num_experts(hf_config) is None and getattr(hf_config, "n_routed_experts", None) is None:
        return ()
    layers = range(int(hf_config.num_hidden_layers))
    if getattr(hf_config, "first_k_dense_replace", None) is not None:
        first = int(hf_config.first_k_dense_replace)
        every = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return tuple(i for i in layers if i >= first and i % every == 0)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
