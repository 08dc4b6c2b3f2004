"""GRPO advantages: each sample's reward normalised within its prompt's group."""

from __future__ import annotations

import numpy as np

ADV_EPS = 1e-6


def group_advantages(rewards: np.ndarray, *, group_size: int, normalize_std: bool = True) -> np.ndarray:
    """A_i = (r_i - mean(group)) / (std(group) + eps), samples of one prompt contiguous, as verl's
    `compute_grpo_outcome_advantage` (`norm_adv_by_std_in_grpo` is `normalize_std`; False: r_i - mean).

    `std` is the unbiased (ddof=1) group std, as in TRL/verl (`torch.std`). A group whose rewards are
    all equal gets advantage 0 (no signal). A group of one sample (`rollout.groupSize: 1`) has no
    baseline: verl gives it mean 0 and std 1, so its advantage is its own reward, r / (1 + eps) (r without
    the std normalisation): plain REINFORCE, every sample pushed by its raw reward.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of rollout.groupSize={group_size}")
    groups = r.reshape(-1, group_size)
    if group_size == 1:
        mean, std = np.zeros_like(groups), np.ones_like(groups)
    else:
        mean = groups.mean(axis=1, keepdims=True)
        std = groups.std(axis=1, ddof=1, keepdims=True)
    centred = groups - mean
    if normalize_std:
        centred = centred / (std + ADV_EPS)
    return centred.reshape(-1).astype(np.float32)
