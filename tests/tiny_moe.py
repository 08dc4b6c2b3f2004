"""Tiny transformers MoE models of every router family the HF replay supports (built in-process), and a batch for
them (not a test module: tests/conftest.py makes the fixtures of them)."""

from __future__ import annotations

from typing import Any

VOCAB = 96


def _common(layers: int = 3, **extra: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {**base, **extra}


def build_tiny_moe(
    family: str, *, seed: int = 0, dtype: Any = None, layers: int = 3, dense_layers: tuple[int, ...] = ()
) -> Any:
    """A random tiny MoE of `family` in eval mode; router weights widened so top-k is not tied.
    `dense_layers` (qwen3_moe only): layers with a dense MLP instead of experts (`mlp_only_layers`)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **_common(
                layers,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                mlp_only_layers=list(dense_layers),
            )
        )
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **_common(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                norm_topk_prob=False,
            )
        )
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**_common(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False))
        model = tf.OlmoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**_common(num_local_experts=8, num_experts_per_tok=2))
        model = tf.MixtralForCausalLM(cfg)
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(
            **_common(
                n_routed_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                n_shared_experts=1,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
            )
        )
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif family == "glm4_moe":
        cfg = tf.Glm4MoeConfig(
            **_common(
                n_routed_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_group=2,
                topk_group=1,
                first_k_dense_replace=1,
                n_shared_experts=1,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
            )
        )
        model = tf.Glm4MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(-0.05, 0.05, buf.numel()))
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


ROWS, WIDTH, LAYERS, EXPERTS, TOP_K = 5, 14, 3, 8, 2  # r3_batch, for build_tiny_moe("qwen3_moe")


def r3_batch(seed: int = 0, layers: int = LAYERS) -> Any:
    """5 right-padded rows of different lengths; every token has engine routes (k distinct experts per
    layer, drawn at random, so they differ from the routers' own choice) except the pad."""
    import torch

    from r3operator.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = [14, 9, 12, 7, 11]
    prompt = 4
    ids = torch.zeros(ROWS, WIDTH, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    resp = torch.zeros(ROWS, WIDTH - 1, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        attn[i, :n] = 1
        resp[i, prompt - 1 : n - 1] = True
    routes = torch.rand(ROWS, WIDTH, layers, EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
    pad = attn == 0
    routes[pad] = 0
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        rollout_logprobs=torch.zeros(ROWS, WIDTH - 1),
        advantages=torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3]),
        engine_routes=routes,
        route_pad=pad,
        sample_ids=[f"s{i}" for i in range(ROWS)],
    )


FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3"]
