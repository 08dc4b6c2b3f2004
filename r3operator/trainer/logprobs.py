"""Trainer-side per-token logprobs, computed the way vLLM computes the sampled token's logprob.

vLLM (V1) takes the model's logits (in the model dtype), casts them to fp32, divides by the temperature
when logprobs are requested as "processed" (our engines run `--logprobs-mode processed_logprobs`,
api/vllm_args.py: the default, raw, ignores the temperature) and applies `log_softmax`. We do the same:
fp32 `log_softmax` over the logits the model produced divided by the rollout temperature
(`TrainBatch.temperature`), gathered at the next token. Top-k/top-p/min-p would also shape vLLM's
processed logprobs; our requests turn them off (`FULL_DISTRIBUTION` in rollout/client.py), so there is no mask.

The operations are vLLM's own (v1/sample/sampler.py: `logits.to(float32)`, `div_` by a float32 temperature
TENSOR, `log_softmax(dim=-1, dtype=float32)`), so equal logits give bit-equal logprobs: `x - logsumexp(x)`
rounds differently (up to 5e-5 apart over a 152k vocabulary), and on CUDA dividing by a Python float is a
multiplication by its reciprocal (one bit off the division vLLM does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature), in fp32. logits [..., V], labels [...]."""
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    scaled = logits.to(torch.float32)
    if temperature != 1.0:
        # Out of place: `.to` returns fp32 logits themselves, which belong to the caller.
        scaled = scaled / torch.tensor(temperature, dtype=torch.float32, device=scaled.device)
    # Autograd keeps the [.., V] log_softmax output, as it would keep `scaled` for logsumexp: no more memory.
    logprobs = torch.log_softmax(scaled, dim=-1, dtype=torch.float32)
    return logprobs.gather(-1, labels.unsqueeze(-1).to(torch.int64)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """The entropy (nats) of softmax(logits / temperature) over the last dimension, in fp32, without grad."""
    import torch

    with torch.no_grad():
        scaled = logits.to(torch.float32)
        if temperature != 1.0:
            scaled = scaled / torch.tensor(temperature, dtype=torch.float32, device=scaled.device)
        logp = torch.log_softmax(scaled, dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)


@overload
def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = ...,
    *,
    position_ids: torch.Tensor | None = ...,
    temperature: float = ...,
    entropy: Literal[False] = ...,
    **forward_kwargs: Any,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = ...,
    *,
    position_ids: torch.Tensor | None = ...,
    temperature: float = ...,
    entropy: Literal[True],
    **forward_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    **forward_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, S-1] fp32: entry t is log p(input_ids[:, t+1] | input_ids[:, :t+1]); with `entropy`, also the
    [B, S-1] entropy of each of those next-token distributions (no grad).

    Response token i of a sample whose prompt has P tokens sits at column `P - 1 + i` (right padding,
    `trainer.batch`). Runs under the caller's grad mode (use `torch.no_grad()` for old-logprob
    passes), so the same function serves the policy-update forward.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **forward_kwargs,
    )
    logits = out.logits[:, :-1]
    lp = logprobs_from_logits(logits, input_ids[:, 1:], temperature=temperature)
    if not entropy:
        return lp
    return lp, entropy_from_logits(logits, temperature=temperature)
