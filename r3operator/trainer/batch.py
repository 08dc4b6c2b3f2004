"""Rollout samples → right-padded training tensors, with replay indices aligned to the inputs.

Right padding keeps every real token at its natural position (HF derives positions from the column
index), so trainer logprobs line up with vLLM's without position_ids bookkeeping; causal attention
never lets a real token see the trailing pad. Response token i of a sample with P prompt tokens sits
at logprob column P - 1 + i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from r3operator.routing.stitch import stack_for_replay

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from r3operator.engine.rollout import RolloutSample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S] int64
    response_mask: torch.Tensor  # [B, S-1] bool, logprob columns of response tokens
    rollout_logprobs: torch.Tensor  # [B, S-1] fp32, engine logprobs at response columns (0 elsewhere)
    advantages: torch.Tensor  # [B] fp32
    engine_routes: torch.Tensor | None  # [B, S, L, K] int64 (dummy rows where route_pad is True)
    route_pad: torch.Tensor | None  # [B, S] bool, True = no captured route
    sample_ids: list[str]

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: Sequence[int]) -> TrainBatch:
        import torch

        idx = torch.as_tensor(list(rows), dtype=torch.int64)
        return TrainBatch(
            input_ids=self.input_ids[idx],
            attention_mask=self.attention_mask[idx],
            response_mask=self.response_mask[idx],
            rollout_logprobs=self.rollout_logprobs[idx],
            advantages=self.advantages[idx],
            engine_routes=None if self.engine_routes is None else self.engine_routes[idx],
            route_pad=None if self.route_pad is None else self.route_pad[idx],
            sample_ids=[self.sample_ids[i] for i in rows],
        )


def build_batch(
    samples: Sequence[RolloutSample],
    advantages: Sequence[float],
    *,
    routes: Sequence[np.ndarray] | None,
    pad_id: int,
    device: Any = "cpu",
) -> TrainBatch:
    """Tensors for `samples`; `routes[i]` is sample i's [P+G-1, L, K] array (None: no replay data)."""
    import torch

    if not samples:
        raise ValueError("build_batch: no samples (every sample was dropped?)")
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
        resp[i, begin : begin + len(sample.token_ids)] = True
        roll[i, begin : begin + len(sample.token_ids)] = sample.logprobs
    engine_routes = route_pad = None
    if routes is not None:
        stacked, pad = stack_for_replay(list(routes), seq_lens=lengths, max_len=width, left_padded=False)
        engine_routes = torch.from_numpy(stacked.astype(np.int64)).to(device)
        route_pad = torch.from_numpy(pad).to(device)
    return TrainBatch(
        input_ids=torch.from_numpy(ids).to(device),
        attention_mask=torch.from_numpy(attn).to(device),
        response_mask=torch.from_numpy(resp).to(device),
        rollout_logprobs=torch.from_numpy(roll).to(device),
        advantages=torch.as_tensor(np.asarray(advantages, dtype=np.float32)).to(device),
        engine_routes=engine_routes,
        route_pad=route_pad,
        sample_ids=[s.sample_id for s in samples],
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
