"""The policy loss against references written out here: verl's dual-clip PPO term, and the spec's
`algorithm.clipRatioC` reaching the trainer's update (a one-process PolicyTrainer on the tiny MoE)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tiny_moe import r3_batch  # noqa: E402

from r3operator.api.enums import ReplayMode  # noqa: E402
from r3operator.trainer.grpo.loss import ppo_clip_loss  # noqa: E402


def verl_dual_clip(log_ratio: float, adv: float, *, low: float, high: float, c: float) -> float:
    """verl `compute_policy_loss_vanilla`, one token: r = exp(clamp(log r, -20, 20)); pg_losses =
    max(-A r, -A clip(r)); for A < 0 min(that, -A c)."""
    ratio = math.exp(min(max(log_ratio, -20.0), 20.0))
    clipped = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    return min(clipped, -adv * c) if adv < 0 else clipped


def verl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    low: float,
    high: float,
    c: float,
) -> torch.Tensor:
    """verl `compute_policy_loss_vanilla` + `agg_loss(token-mean)` (verl/trainer/ppo/core_algos.py), tensors
    [B, T]: the log-ratio clamped to ±20 before exp, PPO clip, dual-clip for A < 0, masked token mean."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return (pg_losses * response_mask).sum() / response_mask.sum()


def test_dual_clip_bounds_negative_advantage_tokens_like_verl() -> None:
    ratios = [5.0, 2.0, 0.5, 5.0]
    advs = [-1.0, -1.0, -1.0, 1.0]  # one token per row: A < 0 with r = 5 is the one the bound changes
    new = torch.log(torch.tensor(ratios))[:, None]
    old = torch.zeros(4, 1)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, stats = ppo_clip_loss(new, old, torch.tensor(advs), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    expected = (
        sum(verl_dual_clip(math.log(r), a, low=0.2, high=0.28, c=3.0) for r, a in zip(ratios, advs, strict=True)) / 4
    )
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert stats.dual_clip_fraction == pytest.approx(1 / 4)
    plain, _ = ppo_clip_loss(new, old, torch.tensor(advs), mask, clip_low=0.2, clip_high=0.28)
    assert float(plain) == pytest.approx((5.0 + 2.0 + 0.8 - 1.28) / 4, rel=1e-6)  # no bound: -A r = 5
    with pytest.raises(ValueError, match=r"algorithm\.clipRatioC must be > 1"):
        ppo_clip_loss(new, old, torch.tensor(advs), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=1.0)


def _random_tokens(seed: int) -> tuple[torch.Tensor, ...]:
    """[6, 9] logprobs, old logprobs, advantages and a mask, some log-ratios far past ±20 (and past 88.7,
    where exp overflows fp32), both signs of advantage, right padding."""
    g = torch.Generator().manual_seed(seed)
    new = -torch.rand(6, 9, generator=g) * 3
    old = new + torch.randn(6, 9, generator=g) * 0.6
    old[0, 2], old[1, 4], old[3, 1], old[4, 0] = new[0, 2] - 95.0, new[1, 4] + 120.0, new[3, 1] - 30.0, new[4, 0] - 21.0
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9, -0.2, 0.9])[:, None].expand(6, 9).contiguous()
    mask = torch.ones(6, 9)
    mask[2, 6:], mask[5, 3:] = 0.0, 0.0
    return new, old, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_are_bit_equal_to_verls_clamped_dual_clip(seed: int) -> None:
    """The loss and d loss / d logprobs equal verl's to the bit, extreme tokens and the dual-clip bound included."""
    new, old, adv, mask = _random_tokens(seed)
    ours_lp = new.clone().requires_grad_(True)
    verl_lp = new.clone().requires_grad_(True)
    ours, _ = ppo_clip_loss(ours_lp, old, adv, mask.bool(), clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    theirs = verl_policy_loss(old, verl_lp, adv, mask, low=0.2, high=0.28, c=3.0)
    ours.backward()
    theirs.backward()
    assert torch.equal(ours.detach(), theirs.detach()), (float(ours), float(theirs))
    assert ours_lp.grad is not None and verl_lp.grad is not None
    assert torch.equal(ours_lp.grad, verl_lp.grad)


@pytest.mark.parametrize("adv", [1.0, -1.0], ids=["positive", "negative"])
def test_one_extreme_token_leaves_the_gradient_finite(adv: float) -> None:
    """A token 100 nats more likely under the policy than under pi_old: exp overflows fp32 past 88.7, and
    without the clamp the clipped branch's gradient is inf × 0 = NaN while the loss stays finite."""
    new = torch.full((2, 4), -1.0, requires_grad=True)
    old = new.detach().clone()
    old[0, 1] = -101.0
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, _ = ppo_clip_loss(new, old, torch.tensor([adv, adv]), mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert new.grad is not None and bool(torch.isfinite(new.grad).all()), new.grad
    assert float(new.grad[0, 1]) == 0.0  # clamped: the token's ratio no longer moves the loss


def test_an_update_over_an_extreme_token_is_applied_and_finite(tiny_moe_dir: Path) -> None:
    """The tiny model's update with one token 100 nats off its old logprob: the update is applied (no
    guard had to skip it) and every parameter stays finite."""
    from r3operator.trainer.hf_policy import PolicyTrainer

    trainer = PolicyTrainer(tiny_moe_dir, device="cpu", learning_rate=1e-3, seed=0, compute_dtype="float32")
    batch = r3_batch()
    old = trainer.old_logprobs(batch, ReplayMode.DISABLED)
    row, col = 0, int(batch.response_mask[0].nonzero()[0])
    old.logprobs[row, col] -= 100.0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.update(batch, old, mini_batches=1, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)
    after = dict(trainer.model.named_parameters())
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before)  # the step was applied


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
