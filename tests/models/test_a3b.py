"""The `a3b` reference model: Qwen3-30B-A3B's layer, four of them. Checked on the meta device (2.5 B
parameters are too many to generate in a CPU test); the GPU command is in docs/up.md."""

from __future__ import annotations

import pytest

from r3operator.models import get_spec

# Qwen3-30B-A3B's config.json (Hugging Face, Qwen/Qwen3-30B-A3B).
QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "model_type": "qwen3_moe",
}
QWEN3_30B_A3B_LAYERS, QWEN3_30B_A3B_VOCAB = 48, 151936
QWEN3_30B_A3B_PARAMS = 30.5e9  # the model card's "Number of Parameters: 30.5B"


def _params(spec) -> int:
    torch = pytest.importorskip("torch")
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(spec.hf_config())
    return sum(p.numel() for p in model.parameters())


def test_a3b_has_qwen3_30b_a3b_layer_shape() -> None:
    config = get_spec("a3b").hf_config()
    assert {k: getattr(config, k) for k in QWEN3_30B_A3B} == QWEN3_30B_A3B
    assert 4 <= config.num_hidden_layers <= 6


def test_a3b_layers_are_the_real_models_layers() -> None:
    """With the real depth and vocabulary the same spec has the real model's parameter count, so the layer
    (attention, router, 128 experts) is Qwen3-30B-A3B's, not just its config numbers."""
    spec = get_spec("a3b").model_copy(
        update={"num_hidden_layers": QWEN3_30B_A3B_LAYERS, "vocab_size": QWEN3_30B_A3B_VOCAB}
    )
    assert _params(spec) == pytest.approx(QWEN3_30B_A3B_PARAMS, rel=0.01)


def test_a3b_trainer_state_fits_one_80_gb_gpu() -> None:
    params = _params(get_spec("a3b"))
    # fp32 weights + fp32 grads + AdamW's two fp32 moments: 16 bytes a parameter.
    assert params > 2.0e9 and params * 16 < 60e9
