"""The reference MoE checkpoint: deterministic, cached atomically, loadable by transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from r3operator.models import REFERENCE_SPECS, ReferenceModelSpec, ensure_reference_model, get_spec
from r3operator.models.tokenizer import vocabulary


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_spec_hash_changes_with_any_field() -> None:
    base = REFERENCE_SPECS["tiny"]
    assert base.content_hash() == ReferenceModelSpec(**base.model_dump()).content_hash()
    assert base.content_hash() != base.model_copy(update={"seed": 1}).content_hash()
    assert base.content_hash() != base.model_copy(update={"router_std": 0.1}).content_hash()


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown reference model 'huge'"):
        get_spec("huge")


def test_vocabulary_is_fixed_and_sized() -> None:
    vocab = vocabulary(512)
    assert len(vocab) == len(set(vocab)) == 512
    assert vocab[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert vocabulary(512) == vocab
    with pytest.raises(ValueError, match="vocab_size"):
        vocabulary(10)


@pytest.mark.slow
def test_generation_is_bitwise_reproducible_and_idempotent(tmp_path: Path) -> None:
    first = ensure_reference_model("tiny", tmp_path / "a")
    second = ensure_reference_model("tiny", tmp_path / "b")
    assert first.name == second.name == f"tiny-{REFERENCE_SPECS['tiny'].content_hash()}"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(first / name) == _sha(second / name), name
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_reference_model("tiny", tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # not regenerated
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no tmp dir left


@pytest.mark.slow
def test_loads_with_transformers_auto_classes(reference_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = json.loads((reference_model_dir / "r3_reference_spec.json").read_text())
    tok = AutoTokenizer.from_pretrained(reference_model_dir)
    assert len(tok) == spec["vocab_size"]
    ids = tok("add 12 + 7 =").input_ids
    assert ids[0] == tok.bos_token_id == 1
    assert tok.convert_ids_to_tokens(ids[1:]) == ["add", "1", "2", "+", "7", "="]
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert "assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "1 + 1"}], tokenize=False, add_generation_prompt=True
    )

    model = AutoModelForCausalLM.from_pretrained(reference_model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    gate = model.model.layers[0].mlp.gate
    assert type(gate).__name__ == "Qwen3MoeTopKRouter"
    assert gate.weight.shape == (spec["num_experts"], spec["hidden_size"])
    # Stored in bf16: upcasting to fp32 and back is exact.
    assert torch.equal(gate.weight.to(torch.bfloat16).float(), gate.weight)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), spec["vocab_size"])
    assert torch.isfinite(logits).all()
    # Not degenerate: the next-token distribution is neither uniform nor one-hot.
    probs = logits[0, -1].softmax(-1)
    assert 0.01 < float(probs.max()) < 0.9


@pytest.mark.slow
def test_router_is_not_tied(reference_model_dir: Path) -> None:
    """Top-k choices have a margin: the k-th and (k+1)-th router probabilities are rarely in bf16 noise."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference_model_dir, dtype=torch.float32)
    gate = model.model.layers[1].mlp.gate
    seen: list[torch.Tensor] = []
    handle = gate.register_forward_hook(lambda _m, _i, out: seen.append(out[0].detach()))
    with torch.no_grad():
        model(torch.randint(4, 100, (2, 48), generator=torch.Generator().manual_seed(0)))
    handle.remove()
    top = seen[0].softmax(-1).topk(gate.top_k + 1, dim=-1).values
    gap = (top[:, -2] - top[:, -1]) / top[:, -2]
    assert float((gap < 1e-3).float().mean()) < 0.05
