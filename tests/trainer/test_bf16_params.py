"""Under bf16 compute the trainer's forwards read every parameter at its bf16 value (the engine's weights),
while the gradient reaches the fp32 masters. The reference is a plain transformers copy of the model whose
parameters this test rounds to bf16 itself, run under the same autocast; the tiny model's random fp32
initialisation is off the bf16 grid, as the masters are after an update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.trainer.hf_policy import PolicyTrainer  # noqa: E402


def reference(model_dir: Path, *, rounded: bool) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    if rounded:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model.eval()


def reference_logprobs(model: Any, ids: Any, attn: Any, *, autocast: bool) -> Any:
    """log p(ids[:, t+1] | ids[:, :t+1]), fp32 log-softmax of the model's logits, temperature 1."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=attn).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, ids[:, 1:, None])[..., 0]


def masked(lp: Any, mask: Any) -> Any:
    return lp * mask


@pytest.fixture(scope="module")
def off_grid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`build_tiny_moe("qwen3_moe")` with its RMSNorm weights (initialised to ones, which bf16 holds) moved
    off the grid like an update moves them; the random embedding is off it already."""
    from tiny_moe import build_tiny_moe

    model = build_tiny_moe("qwen3_moe")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.linspace(-3e-3, 3e-3, param.numel()))
    path = tmp_path_factory.mktemp("off-grid-moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bf16_trainer(off_grid_dir: Path) -> PolicyTrainer:
    return PolicyTrainer(off_grid_dir, device="cpu", learning_rate=1e-4, seed=0)


def test_the_weights_are_off_the_bf16_grid(off_grid_dir: Path) -> None:
    params = dict(reference(off_grid_dir, rounded=False).named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert not torch.equal(params[name], params[name].to(torch.bfloat16).float()), name


def test_old_logprobs_are_the_bf16_rounded_models_bit_for_bit(bf16_trainer: PolicyTrainer, off_grid_dir: Path) -> None:
    batch = r3_batch()
    lp = bf16_trainer.old_logprobs(batch, ReplayMode.DISABLED).logprobs
    engine_view = reference_logprobs(
        reference(off_grid_dir, rounded=True), batch.input_ids, batch.attention_mask, autocast=True
    )
    unrounded = reference_logprobs(
        reference(off_grid_dir, rounded=False), batch.input_ids, batch.attention_mask, autocast=True
    )
    mask = batch.response_mask
    assert torch.equal(masked(lp, mask), masked(engine_view, mask))
    # What the trainer computed before it rounded: fp32 embedding and norm weights under autocast.
    assert not torch.equal(masked(unrounded, mask), masked(engine_view, mask))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_the_training_forward_and_its_gradients_are_the_rounded_models(off_grid_dir: Path, checkpointing: bool) -> None:
    """The update's forward (train mode, compute context) gives the rounded copy's logprobs, and the fp32
    masters get the rounded copy's gradients (straight-through); with gradient checkpointing the backward's
    recompute rounds too."""
    from r3operator.trainer.logprobs import token_logprobs

    trainer = PolicyTrainer(
        off_grid_dir, device="cpu", learning_rate=1e-4, seed=0, gradient_checkpointing=checkpointing
    )
    ref = reference(off_grid_dir, rounded=True).train()
    batch = r3_batch()
    trainer.model.train()
    with trainer._compute():
        lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    (lp * batch.response_mask).sum().backward()
    ref_lp = reference_logprobs(ref, batch.input_ids, batch.attention_mask, autocast=True)
    (ref_lp * batch.response_mask).sum().backward()

    assert torch.equal(masked(lp, batch.response_mask), masked(ref_lp, batch.response_mask))
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert (grad is None) == (ref_grads[name] is None), name
        if grad is not None:
            assert grad.dtype == torch.float32, name
            assert torch.equal(grad, ref_grads[name]), name
    assert grads["model.embed_tokens.weight"] is not None and grads["model.norm.weight"] is not None


def test_a_small_step_moves_the_fp32_masters_below_bf16_spacing(off_grid_dir: Path) -> None:
    """AdamW's first step moves each parameter by about lr; at 1e-7 the bf16 values stay, the fp32 ones move:
    the optimizer steps the masters, not their rounding."""
    trainer = PolicyTrainer(off_grid_dir, device="cpu", learning_rate=1e-7, seed=0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.sft_step([[5, 6, 7, 8]], [[9, 10, 11, 2]])
    after = dict(trainer.model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.post_attention_layernorm.weight"):
        assert not torch.equal(after[name], before[name]), name
    moved = sum(int((after[n].detach().bfloat16() != before[n].bfloat16()).sum()) for n in before)
    changed = sum(int((after[n].detach() != before[n]).sum()) for n in before)
    assert changed > 0
    assert moved < 0.01 * changed


def test_the_fp32_canary_forward_reads_the_unrounded_masters(bf16_trainer: PolicyTrainer, off_grid_dir: Path) -> None:
    sequence = [1, 7, 9, 11, 13, 17, 19]
    ids = torch.tensor([sequence])
    with torch.no_grad():
        fp32 = reference(off_grid_dir, rounded=False)(input_ids=ids).logits[0]
        engine_view = reference(off_grid_dir, rounded=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = engine_view(input_ids=ids).logits[0].float()
    assert torch.equal(bf16_trainer.canary_logits(sequence), fp32)
    natural = torch.ones(1, len(sequence), dtype=torch.bool)
    no_routes = torch.zeros(1, len(sequence), bf16_trainer.num_layers, 2, dtype=torch.int64)
    compute = bf16_trainer.canary_forward(sequence, no_routes, natural, compute=True)
    assert torch.equal(compute.logits, bf16)
    # the hooks put every parameter back after each forward
    assert all(isinstance(p, torch.nn.Parameter) for p in bf16_trainer.model.parameters())


def test_float32_compute_reads_fp32(off_grid_dir: Path) -> None:
    trainer = PolicyTrainer(off_grid_dir, device="cpu", learning_rate=1e-4, seed=0, compute_dtype="float32")
    batch = r3_batch()
    lp = trainer.old_logprobs(batch, ReplayMode.DISABLED).logprobs
    with torch.no_grad():
        ref = reference_logprobs(
            reference(off_grid_dir, rounded=False), batch.input_ids, batch.attention_mask, autocast=False
        )
    assert torch.equal(masked(lp, batch.response_mask), masked(ref, batch.response_mask))
