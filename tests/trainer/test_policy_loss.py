"""The policy loss against references written out here: verl's dual-clip PPO term, and the spec's
`algorithm.clipRatioC` reaching the trainer's update (a one-process PolicyTrainer on the tiny MoE)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.trainer.grpo.loss import ppo_clip_loss  # noqa: E402
from tests.trainer.conftest import r3_batch  # noqa: E402


def verl_dual_clip(ratio: float, adv: float, *, low: float, high: float, c: float) -> float:
    """verl `compute_policy_loss` (vanilla), one token: pg_losses = max(-A r, -A clip(r)); for A < 0
    min(that, -A c)."""
    clipped = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(clipped, -adv * c) if adv < 0 else clipped


def test_dual_clip_bounds_negative_advantage_tokens_like_verl() -> None:
    ratios = [5.0, 2.0, 0.5, 5.0]
    advs = [-1.0, -1.0, -1.0, 1.0]  # one token per row: A < 0 with r = 5 is the one the bound changes
    new = torch.log(torch.tensor(ratios))[:, None]
    old = torch.zeros(4, 1)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, stats = ppo_clip_loss(new, old, torch.tensor(advs), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    expected = sum(verl_dual_clip(r, a, low=0.2, high=0.28, c=3.0) for r, a in zip(ratios, advs, strict=True)) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert stats.dual_clip_fraction == pytest.approx(1 / 4)
    plain, _ = ppo_clip_loss(new, old, torch.tensor(advs), mask, clip_low=0.2, clip_high=0.28)
    assert float(plain) == pytest.approx((5.0 + 2.0 + 0.8 - 1.28) / 4, rel=1e-6)  # no bound: -A r = 5
    with pytest.raises(ValueError, match=r"algorithm\.clipRatioC must be > 1"):
        ppo_clip_loss(new, old, torch.tensor(advs), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=1.0)


def test_the_spec_default_clip_ratio_c_reaches_the_update(tiny_moe_dir: Path) -> None:
    """Old logprobs 5 nats below the policy's (a very stale sample): on-policy rows' ratios are e^5. With
    the spec's default clipRatioC = 3 every negative-advantage token contributes -A·3 exactly."""
    from r3operator.api.v1alpha1 import AlgorithmSpec
    from r3operator.trainer.hf_policy import PolicyTrainer

    c = AlgorithmSpec().clip_ratio_c
    assert c == 3.0
    trainer = PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=1e-6, seed=0, compute_dtype="float32")
    batch = r3_batch()
    old = trainer.old_logprobs(batch, ReplayMode.DISABLED)
    old.logprobs = old.logprobs - 5.0
    stats = trainer.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28, clip_ratio_c=c)
    tokens = batch.response_mask.sum(dim=1).float()
    adv = batch.advantages
    per_row = torch.where(adv < 0, -adv * c, -adv * (1 + 0.28))  # A > 0: clipped at 1 + clip_high
    assert stats.loss == pytest.approx(float((per_row * tokens).sum() / tokens.sum()), rel=1e-5)


def test_the_trainer_scores_tokens_at_the_rollout_temperature(tiny_moe_dir: Path) -> None:
    """Reference: log_softmax(logits / T) of a plain transformers forward, gathered at the next token. The
    old-logprob pass must give it at T = 0.6, and the update (same weights) must see ratio 1 everywhere, so
    its on-policy loss is -sum_i A_i n_i / sum_i n_i."""
    from transformers import AutoModelForCausalLM

    from r3operator.trainer.hf_policy import PolicyTrainer

    temperature = 0.6
    batch = r3_batch()
    batch.temperature = temperature
    plain = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]

    trainer = PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=1e-6, seed=0, compute_dtype="float32")
    old = trainer.old_logprobs(batch, ReplayMode.DISABLED)
    mask = batch.response_mask
    assert (old.logprobs - expected)[mask].abs().max() < 1e-4
    stats = trainer.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28)
    tokens = mask.sum(dim=1).float()
    assert stats.loss == pytest.approx(float(-(batch.advantages * tokens).sum() / tokens.sum()), rel=1e-4)
    assert stats.clip_fraction == 0.0


def test_greedy_rollouts_are_scored_unscaled_as_vllm_reports_them() -> None:
    from r3operator.trainer.batch import scoring_temperature

    assert scoring_temperature(0.6) == 0.6
    assert scoring_temperature(0.0) == 1.0  # vLLM's processed logprobs of a greedy request: plain log_softmax
    # vLLM samples greedily (and reports unscaled logprobs) below its _SAMPLING_EPS = 1e-5, not only at 0.
    assert scoring_temperature(9e-6) == 1.0
    assert scoring_temperature(1e-5) == 1e-5
    with pytest.raises(ValueError, match=r"rollout\.temperature"):
        scoring_temperature(-1.0)
