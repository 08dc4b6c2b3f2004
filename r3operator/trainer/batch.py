"""Rollout samples → right-padded training tensors, with replay indices aligned to the inputs.

The one batch builder: the runtime, the benchmarks and both trainer backends consume `TrainBatch`.
Right padding keeps every real token at its natural position (HF and Megatron both derive RoPE
positions from the column index), so trainer logprobs line up with vLLM's without position_ids
bookkeeping; causal attention never lets a real token see the trailing pad. Response token i of a
sample with P prompt tokens sits at logprob column P - 1 + i. A sample's `loss_mask` (a multi-turn
trajectory's environment tokens are False) takes tokens out of `response_mask`, never out of the input.

Route row r of a sample is absolute token position `routes.start + r` (the request's
`routed_experts_prompt_start`), so it lands in column `start + r`; columns without a captured route
(an uncaptured prefix, the last sampled token, the pad) are flagged in `route_pad` and route
naturally in both replay backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from r3operator.routing.codec import RoutedExperts
from r3operator.routing.placement import place_routes

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from r3operator.routing.sample import RolloutSample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S] int64
    response_mask: torch.Tensor  # [B, S-1] bool, logprob columns of response tokens
    rollout_logprobs: torch.Tensor  # [B, S-1] fp32, engine logprobs at response columns (0 elsewhere)
    advantages: torch.Tensor  # [B] fp32
    engine_routes: torch.Tensor | None  # [B, S, L, K] int64 (zero rows where route_pad is True)
    route_pad: torch.Tensor | None  # [B, S] bool, True = no captured route
    sample_ids: list[str]
    temperature: float = 1.0
    """What the trainer divides logits by to score these tokens: the rollout temperature they were sampled
    at (`scoring_temperature`), so that log pi is the sampling distribution's, as the engine reports it."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Sequence[int]) -> TrainBatch:
        import torch

        picked = [int(i) for i in rows]  # ints or 0-d tensors (a torch.arange split) alike
        idx = torch.as_tensor(picked, dtype=torch.int64, device=self.input_ids.device)
        return TrainBatch(
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            response_mask=self.response_mask[idx],
            rollout_logprobs=self.rollout_logprobs[idx],
            advantages=self.advantages[idx],
            engine_routes=None if self.engine_routes is None else self.engine_routes[idx],
            route_pad=None if self.route_pad is None else self.route_pad[idx],
            sample_ids=[self.sample_ids[i] for i in picked],
            temperature=self.temperature,
        )

    @property
    def lengths(self) -> list[int]:
        """Each row's real length (prompt + response tokens; the rest is right padding)."""
        return [int(n) for n in self.attention_mask.sum(dim=1).tolist()]

    def trimmed(self) -> TrainBatch:
        """The same rows cut to the longest one: the columns after it are padding in every row, and with right
        padding no real token attends to them, so the logprobs and routes of the real tokens do not change."""
        width = max(max(self.lengths), 2)
        if width >= self.input_ids.shape[1]:
            return self
        return TrainBatch(
            input_ids=self.input_ids[:, :width],
            attention_mask=self.attention_mask[:, :width],
            response_mask=self.response_mask[:, : width - 1],
            rollout_logprobs=self.rollout_logprobs[:, : width - 1],
            advantages=self.advantages,
            engine_routes=None if self.engine_routes is None else self.engine_routes[:, :width],
            route_pad=None if self.route_pad is None else self.route_pad[:, :width],
            sample_ids=self.sample_ids,
            temperature=self.temperature,
        )


GREEDY_BELOW = 1e-5
"""vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py, v1/sample/sampler.py): a request whose temperature is below
it is sampled greedily, and its processed logprobs are those of the unscaled logits (temperature 1)."""


def scoring_temperature(rollout_temperature: float) -> float:
    """The logits divisor that scores a token like the engine's `processed_logprobs` (api/vllm_args.py):
    the sampling temperature; 1 for greedy rollouts (T < `GREEDY_BELOW`, T = 0 included), whose logprobs
    vLLM reports unscaled."""
    if rollout_temperature < 0:
        raise ValueError(f"rollout.temperature must be >= 0, got {rollout_temperature}")
    return rollout_temperature if rollout_temperature >= GREEDY_BELOW else 1.0


def build_batch(
    samples: Sequence[RolloutSample],
    advantages: Sequence[float],
    *,
    routes: Sequence[RoutedExperts] | None,
    pad_id: int,
    device: Any = "cpu",
    temperature: float = 1.0,
) -> TrainBatch:
    """Tensors for `samples`; `routes[i]` is sample i's routes (rows from `routes[i].start`), None: no replay.
    `temperature`: the rollout temperature the samples were drawn at."""
    import torch

    if not samples:
        raise ValueError("build_batch: no samples (every sample was dropped?)")
    if len(advantages) != len(samples):
        raise ValueError(f"build_batch: {len(samples)} samples but {len(advantages)} advantages")
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    width = max(lengths)
    ids = np.full((len(samples), width), pad_id, dtype=np.int64)
    attn = np.zeros((len(samples), width), dtype=np.int64)
    resp = np.zeros((len(samples), width - 1), dtype=bool)
    roll = np.zeros((len(samples), width - 1), dtype=np.float32)
    for i, sample in enumerate(samples):
        seq = sample.sequence
        ids[i, : len(seq)] = seq
        attn[i, : len(seq)] = 1
        begin = len(sample.prompt_token_ids) - 1
        trained = np.ones(len(sample.token_ids), dtype=bool) if sample.loss_mask is None else sample.loss_mask
        if trained.shape != (len(sample.token_ids),):
            raise ValueError(
                f"build_batch: sample {sample.sample_id!r} has a loss mask of {trained.shape[0]} "
                f"entries for {len(sample.token_ids)} generated tokens"
            )
        resp[i, begin : begin + len(sample.token_ids)] = trained
        roll[i, begin : begin + len(sample.token_ids)] = np.where(trained, sample.logprobs, 0.0)
    engine_routes = route_pad = None
    if routes is not None:
        if len(routes) != len(samples):
            raise ValueError(f"build_batch: {len(samples)} samples but {len(routes)} route arrays")
        placed, no_route = place_routes(routes, lengths=lengths, width=width, sample_ids=[s.sample_id for s in samples])
        engine_routes = torch.from_numpy(placed).to(device)
        route_pad = torch.from_numpy(no_route).to(device)
    return TrainBatch(
        input_ids=torch.from_numpy(ids).to(device),
        attention_mask=torch.from_numpy(attn).to(device),
        response_mask=torch.from_numpy(resp).to(device),
        rollout_logprobs=torch.from_numpy(roll).to(device),
        advantages=torch.as_tensor(np.asarray(advantages, dtype=np.float32)).to(device),
        engine_routes=engine_routes,
        route_pad=route_pad,
        sample_ids=[s.sample_id for s in samples],
        temperature=scoring_temperature(temperature),
    )


def sft_tensors(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *, pad_id: int
) -> tuple[Any, Any, Any]:
    """Right-padded (input_ids, attention_mask, answer_mask [B, S-1]) for the supervised warm-up.

    answer_mask marks the next-token positions whose targets are answer tokens (the loss positions).
    """
    import torch

    seqs = [list(p) + list(a) for p, a in zip(prompts, answers, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
        ids[i, : len(seq)] = torch.as_tensor(seq)
        attn[i, : len(seq)] = 1
        mask[i, len(prompt) - 1 : len(seq) - 1] = True
    return ids, attn, mask
