"""Truncated importance weights (asynchronous mode) and their place in the PPO-clip loss, hand-computed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from r3operator.trainer.grpo.loss import ppo_clip_loss, truncated_importance_weights  # noqa: E402


def test_weights_are_the_probability_ratio_truncated_at_the_cap_and_zero_off_mask() -> None:
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2, 0.3]]))
    rollout = torch.log(torch.tensor([[0.25, 0.9, 0.8, 0.01]]))  # ratios 2.0, 1.0, 0.25, 30 (masked out)
    mask = torch.tensor([[True, True, True, False]])
    weights, stats = truncated_importance_weights(old, rollout, mask, cap=1.5)
    np.testing.assert_allclose(weights.numpy(), [[1.5, 1.0, 0.25, 0.0]], rtol=1e-6)
    assert stats.weight_mean == pytest.approx((1.5 + 1.0 + 0.25) / 3)
    assert stats.truncated_fraction == pytest.approx(1 / 3)  # the masked ratio of 30 does not count
    assert not weights.requires_grad


def test_weights_carry_no_gradient_even_from_tensors_that_do() -> None:
    old = torch.zeros(1, 2, requires_grad=True)
    weights, _ = truncated_importance_weights(old, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), cap=2.0)
    assert not weights.requires_grad


def test_bad_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="cap must be positive"):
        truncated_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), cap=0)


def test_loss_scales_each_tokens_term_by_its_weight() -> None:
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    mask = torch.tensor([[True, True, False]])
    weights = torch.tensor([[2.0, 0.5, 7.0]])
    # A = +1: token0 -1.28 (clipped) * 2.0 = -2.56; token1 -0.5 * 0.5 = -0.25; token2 masked -> mean -1.405
    loss, stats = ppo_clip_loss(
        new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28, importance_weights=weights
    )
    assert float(loss) == pytest.approx(-1.405, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)  # the clip decision is PPO's, not the weight's
    # gradient: only token1 is unclipped; d/dlp of -A*r*w = -r*w = -0.25
    new = new.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(
        new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28, importance_weights=weights
    )
    loss.backward()
    np.testing.assert_allclose(new.grad.numpy(), [[0.0, -0.125, 0.0]], atol=1e-6)


def test_unit_weights_give_the_on_policy_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    new, old = torch.randn(3, 5, generator=gen) * 0.3, torch.randn(3, 5, generator=gen) * 0.3
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.rand(3, 5, generator=gen) > 0.3
    plain, _ = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    weighted, _ = ppo_clip_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, importance_weights=torch.ones(3, 5))
    assert float(weighted) == pytest.approx(float(plain), abs=1e-7)


def test_stale_tokens_from_a_much_likelier_rollout_are_damped() -> None:
    """A token the rollout policy found far likelier than the current one (a stale sample) contributes
    less: its weight pi_old/pi_rollout < 1 scales its advantage term down."""
    old = torch.log(torch.tensor([[0.1]]))
    rollout = torch.log(torch.tensor([[0.8]]))
    weights, _ = truncated_importance_weights(old, rollout, torch.ones(1, 1, dtype=torch.bool), cap=2.0)
    assert float(weights) == pytest.approx(0.125)
    loss, _ = ppo_clip_loss(
        old,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        clip_low=0.2,
        clip_high=0.28,
        importance_weights=weights,
    )
    assert float(loss) == pytest.approx(-0.125)


def test_shape_mismatch_is_named() -> None:
    with pytest.raises(ValueError, match="importance_weights has shape"):
        ppo_clip_loss(
            torch.zeros(1, 3),
            torch.zeros(1, 3),
            torch.tensor([1.0]),
            torch.ones(1, 3, dtype=torch.bool),
            clip_low=0.2,
            clip_high=0.2,
            importance_weights=torch.ones(1, 2),
        )


def test_ranks_importance_figures_combine_token_weighted_and_stay_nan_without_weights() -> None:
    from r3operator.trainer.shards import ShareStats, combine_update

    # two mini-batches, two ranks: rank 0 has 3 tokens at weight 1.0, rank 1 has 1 token at weight 0.6
    rank0 = [ShareStats(0.1, 0.0, 0.0, 3, 1.0, 1.0, 0.0), ShareStats(0.1, 0.0, 0.0, 2, 1.0, 0.5, 0.5)]
    rank1 = [ShareStats(0.1, 0.0, 0.0, 1, 1.0, 0.6, 1.0), ShareStats(0.1, 0.0, 0.0, 2, 1.0, 1.5, 0.0)]
    stats = combine_update([rank0, rank1])
    # mini-batch 1: (3 * 1.0 + 1 * 0.6) / 4 = 0.9; mini-batch 2: (2 * 0.5 + 2 * 1.5) / 4 = 1.0 -> mean 0.95
    assert stats.importance_weight_mean == pytest.approx(0.95)
    assert stats.importance_truncated_fraction == pytest.approx((0.25 + 0.25) / 2)
    plain = combine_update([[ShareStats(0.1, 0.0, 0.0, 3, 1.0)]])
    assert np.isnan(plain.importance_weight_mean) and np.isnan(plain.importance_truncated_fraction)
