"""Trainer-side per-token logprobs, computed the way vLLM computes the sampled token's logprob.

vLLM (V1) takes the model's logits (in the model dtype), casts them to fp32, divides by the temperature
only when logprobs are requested as "processed" (the default returns raw logprobs; with temperature 1
the two coincide) and applies `log_softmax`. We do the same: fp32 `log_softmax` over the logits the
model produced, gathered at the next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature), in fp32. logits [..., V], labels [...]."""
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    # gather(logit) - logsumexp avoids materialising the full [.., V] log_softmax twice.
    picked = scaled.gather(-1, labels.unsqueeze(-1).to(torch.int64)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    **forward_kwargs: Any,
) -> torch.Tensor:
    """[B, S-1] fp32: entry t is log p(input_ids[:, t+1] | input_ids[:, :t+1]).

    Response token i of a sample whose prompt has P tokens (and `left_pad` padding) sits at column
    `left_pad + P - 1 + i`. Runs under the caller's grad mode (use `torch.no_grad()` for old-logprob
    passes), so the same function serves the policy-update forward.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **forward_kwargs,
    )
    return logprobs_from_logits(out.logits[:, :-1], input_ids[:, 1:], temperature=temperature)


@dataclass(frozen=True)
class ReplayBatch:
    """A left-padded trainer batch built from rollout samples, aligned with `token_logprobs` columns.

    input_ids/attention_mask/position_ids: [B, S]; rollout_logprobs/response_mask: [B, S-1] (column t
    holds token t+1); replay_indices: [B, S, L, K] int64 and replay_padding_mask: [B, S] (True = no
    captured route) or None when a sample has no routes.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    rollout_logprobs: torch.Tensor
    response_mask: torch.Tensor
    replay_indices: torch.Tensor | None
    replay_padding_mask: torch.Tensor | None


def batch_from_samples(samples: Sequence[Any], *, pad_token_id: int = 0, top_k: int | None = None) -> ReplayBatch:
    """Left-pad `RolloutSample`s into one batch; routes placed at their absolute positions.

    A sample's routes start at absolute position `routes.start` (the request's
    `routed_experts_prompt_start`); rows before it, the final sampled token and left padding are
    flagged in the padding mask (the replay hook routes them naturally).
    """
    import numpy as np
    import torch

    from r3operator.routing.codec import decode
    from r3operator.routing.stitch import pad_for_replay

    if not samples:
        raise ValueError("batch_from_samples needs at least one sample")
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    width = max(lengths)
    b = len(samples)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((b, width), dtype=torch.int64)
    rollout_lp = torch.zeros((b, width - 1), dtype=torch.float32)
    response_mask = torch.zeros((b, width - 1), dtype=torch.bool)
    with_routes = all(s.routes is not None for s in samples)
    indices, masks = [], []
    for i, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        pad = width - n
        input_ids[i, pad:] = torch.tensor(sample.sequence, dtype=torch.int64)
        attention_mask[i, pad:] = 1
        first = pad + len(sample.prompt_token_ids) - 1  # column of the first response token
        rollout_lp[i, first : first + len(sample.token_ids)] = torch.from_numpy(sample.logprobs)
        response_mask[i, first : first + len(sample.token_ids)] = True
        if with_routes:
            routes = decode(sample.routes, validate=False)
            idx, mask = pad_for_replay(routes, seq_len=width, left_pad=pad + sample.routes.start, top_k=top_k)
            mask[: pad + sample.routes.start] = True
            indices.append(idx.astype(np.int64, copy=False))
            masks.append(mask)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return ReplayBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        rollout_logprobs=rollout_lp,
        response_mask=response_mask,
        replay_indices=torch.from_numpy(np.stack(indices)) if with_routes else None,
        replay_padding_mask=torch.from_numpy(np.stack(masks)) if with_routes else None,
    )
