"""Qwen3-MoE (transformers) config -> megatron-core TransformerConfig for the LOCAL layer spec.

What HF `Qwen3MoeForCausalLM` computes and the matching megatron-core switch:

- RMSNorm (eps = rms_norm_eps) before attention / MLP and at the end -> normalization="RMSNorm";
- per-head RMSNorm on q and k before RoPE -> qk_layernorm=True;
- RoPE, rotate-half (not interleaved), theta from rope_parameters -> position_embedding_type="rope";
- GQA: num_key_value_heads groups, head_dim -> num_query_groups, kv_channels;
- SwiGLU experts, no bias -> gated_linear_unit=True, activation silu, add_bias_linear=False;
- router: bf16 linear, fp32 softmax over all experts, top-k, renormalised when norm_topk_prob. Softmax
  over the k gathered logits equals renormalised top-k probabilities, so norm_topk_prob=True maps to
  moe_router_pre_softmax=False; norm_topk_prob=False to pre-softmax without renorm;
- no shared experts; dense layers (mlp_only_layers / decoder_sparse_step) -> moe_layer_freq pattern;
- untied embeddings -> share_embeddings_and_output_weights=False (tie_word_embeddings passes through).

Aux losses are off (replay changes what they would count) and dropout is 0.
"""

from __future__ import annotations

from typing import Any

from r3operator.trainer.megatron.parallel import ParallelSizes

# Any: Megatron-Core ships no type information: its configs are Any here.


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """1 = MoE layer, 0 = dense, per Qwen3MoeDecoderLayer's own rule."""
    skip = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    return [
        1 if (i not in skip and experts > 0 and (i + 1) % step == 0) else 0 for i in range(hf_config.num_hidden_layers)
    ]


def rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config(
    hf_config: Any,
    sizes: ParallelSizes,
    *,
    dtype: Any,
    device: str,
    router_fusion: bool = False,
    recompute: bool = False,
) -> Any:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if getattr(hf_config, "model_type", "qwen3_moe") not in ("qwen3_moe",):
        raise ValueError(f"the Megatron backend builds Qwen3-MoE models; got model_type={hf_config.model_type!r}")
    if sizes.cp > 1:
        raise ValueError(
            "trainer.megatron.contextParallelSize > 1 needs Transformer Engine attention; the local layer spec's "
            "DotProductAttention supports context parallel size 1 only"
        )
    if router_fusion:  # refuse before TransformerConfig checks fusion prerequisites (TE) with a vaguer error
        from types import SimpleNamespace

        from r3operator.trainer.replay.megatron import check_replay_config

        check_replay_config(SimpleNamespace(moe_router_fusion=True, moe_enable_routing_replay=True))
    cuda = device.startswith("cuda")
    extra: dict[str, Any] = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_config.head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_enable_routing_replay=True,
        moe_router_fusion=router_fusion,
        moe_token_dispatcher_type="alltoall" if (cuda and sizes.ep > 1) else "allgather",
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        variable_seq_lengths=cuda and sizes.ep > 1,  # allgather dispatcher refuses it; only PP uses it
        use_cpu_initialization=True,
        perform_initialization=False,
        tensor_model_parallel_size=sizes.tp,
        pipeline_model_parallel_size=sizes.pp,
        context_parallel_size=sizes.cp,
        expert_model_parallel_size=sizes.ep,
        expert_tensor_parallel_size=sizes.etp,
        sequence_parallel=sizes.sequence_parallel,
        **extra,
    )
