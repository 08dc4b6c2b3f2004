"""PPO-clip policy loss (asymmetric clip, DAPO-style token mean) for GRPO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class LossStats:
    clip_fraction: float
    ratio_mean: float
    approx_kl: float


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, LossStats]:
    """Token-mean of max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high)), r = exp(logprobs - old_logprobs).

    logprobs/old_logprobs/mask are [B, T]; advantages is [B] (one per sample) or [B, T]. The mean runs
    over all masked tokens of the batch (each token weighs the same, as in DAPO), so long responses are
    not down-weighted per token.
    """
    import torch

    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    mask_f = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask_f
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    tokens = mask_f.sum().clamp(min=1.0)
    loss = (per_token * mask_f).sum() / tokens
    with torch.no_grad():
        stats = LossStats(
            clip_fraction=float(((clipped > unclipped).to(mask_f.dtype) * mask_f).sum() / tokens),
            ratio_mean=float((ratio * mask_f).sum() / tokens),
            approx_kl=float((((ratio - 1) - log_ratio) * mask_f).sum() / tokens),
        )
    return loss, stats
