"""How one step's batch is split over the trainer's data-parallel ranks, and how their results combine.

FSDP2 averages gradients over ranks, so a rank whose loss is its own token-mean scaled by
`local tokens / mini-batch tokens × world` contributes exactly its share of the single-process loss
(the token-mean over the whole mini-batch, `grpo/loss.py`): the gradients, the clipped norm and the
AdamW step equal the single-process ones up to summation order.

Every rank must run the same number of forwards and backwards (each one all-gathers the sharded
parameters), so a rank without rows in a mini-batch gets one padding row with weight 0: its
forward and backward happen, its loss contributes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from r3operator.trainer.base import OldPass, UpdateStats, mini_batch_rows
from r3operator.trainer.batch import TrainBatch

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class Share:
    """One rank's part of one mini-batch."""

    rows: list[int]  # positions in the rank's own slice (RankPlan.rows), not batch rows
    weight: float  # the loss multiplier: local tokens / mini-batch tokens × world; 0 for padding
    padding: bool = False  # a stand-in row for a rank with nothing in this mini-batch


@dataclass
class RankPlan:
    rows: list[int] = field(default_factory=list)  # the batch rows this rank receives, in slice order
    shares: list[Share] = field(default_factory=list)  # one per mini-batch, in order


@dataclass(frozen=True)
class ShareStats:
    """A rank's result for one share: its token-means and the tokens they are over."""

    loss: float
    clip_fraction: float
    approx_kl: float
    tokens: int
    grad_norm: float  # of the whole (all-rank) gradient: the same on every rank
    importance_weight_mean: float = float("nan")  # asynchronous mode (importance_cap): token-mean TIS weight
    importance_truncated_fraction: float = float("nan")
    dual_clip_fraction: float = float("nan")  # token-mean; NaN where the backend does not report it
    applied: bool = True  # False: the non-finite guard skipped the optimizer step (the same on every rank)


def forward_rows(n: int, world: int) -> list[tuple[list[int], bool]]:
    """Each rank's rows for a forward over all `n` rows (contiguous blocks), with a padding flag: a rank
    left without rows (n < world) gets row 0 and discards its result."""
    if n < 1 or world < 1:
        raise ValueError(f"forward_rows: need at least one row and one rank, got {n} rows, {world} ranks")
    base, extra = divmod(n, world)
    out, start = [], 0
    for rank in range(world):
        size = base + (1 if rank < extra else 0)
        out.append((list(range(start, start + size)), False) if size else ([0], True))
        start += size
    return out


def update_plan(tokens: Sequence[int], *, mini_batches: int, world: int) -> list[RankPlan]:
    """Per rank: the rows it receives and its share of each mini-batch (`mini_batch_rows`, then strided
    over ranks). `tokens[i]` is row i's count of loss tokens (its response mask)."""
    plans = [RankPlan() for _ in range(world)]
    for rows in mini_batch_rows(len(tokens), mini_batches):
        total = sum(int(tokens[i]) for i in rows)
        for rank, plan in enumerate(plans):
            mine = rows[rank::world]
            padding = not mine
            if padding:
                mine = rows[:1]
            local = sum(int(tokens[i]) for i in mine)
            weight = 0.0 if padding or total == 0 else local / total * world
            start = len(plan.rows)
            plan.rows.extend(mine)
            plan.shares.append(Share(list(range(start, start + len(mine))), weight, padding))
    return plans


def combine_update(per_rank: Sequence[Sequence[ShareStats]]) -> UpdateStats:
    """The single-process `UpdateStats` from every rank's per-mini-batch results: token-weighted means
    within a mini-batch, plain means over mini-batches (as the single-process update reports them)."""
    losses, clips, kls, duals, norms, tokens, skipped = [], [], [], [], [], 0, 0
    weights: list[float] = []
    truncated: list[float] = []
    for number, parts in enumerate(zip(*per_rank, strict=True), start=1):
        if len({p.applied for p in parts}) > 1:  # the guard's all-reduce makes this impossible
            raise RuntimeError(f"mini-batch {number}: the ranks disagree whether its optimizer step was applied")
        skipped += int(not parts[0].applied)
        total = sum(p.tokens for p in parts)
        if len(parts) == 1:
            loss, clip, kl, dual = (
                parts[0].loss,
                parts[0].clip_fraction,
                parts[0].approx_kl,
                parts[0].dual_clip_fraction,
            )
        elif total:
            loss = sum(p.loss * p.tokens for p in parts) / total
            clip = sum(p.clip_fraction * p.tokens for p in parts) / total
            kl = sum(p.approx_kl * p.tokens for p in parts) / total
            dual = sum(p.dual_clip_fraction * p.tokens for p in parts) / total
        else:
            loss = clip = kl = dual = 0.0
        losses.append(loss)
        clips.append(clip)
        kls.append(kl)
        duals.append(dual)
        norms.append(parts[0].grad_norm)
        tokens += total
        weighted = [p for p in parts if p.tokens and p.importance_weight_mean == p.importance_weight_mean]
        if weighted:  # token-weighted like the loss; NaN (no importance weights) parts stay out
            n = sum(p.tokens for p in weighted)
            weights.append(sum(p.importance_weight_mean * p.tokens for p in weighted) / n)
            truncated.append(sum(p.importance_truncated_fraction * p.tokens for p in weighted) / n)
    count = max(len(losses), 1)
    nan = float("nan")
    weight_mean, truncated_fraction = (
        (sum(weights) / len(weights), sum(truncated) / len(truncated)) if weights else (nan, nan)
    )
    return UpdateStats(
        sum(losses) / count,
        sum(clips) / count,
        sum(kls) / count,
        sum(norms) / count,
        tokens,
        importance_weight_mean=weight_mean,
        importance_truncated_fraction=truncated_fraction,
        updates=len(losses),
        updates_skipped=skipped,
        dual_clip_fraction=sum(duals) / count,
    )


class UpdateByShares(ABC):
    """`Trainer.update` and `Trainer.sft_step` of a one-process trainer through its own `update_shares` and
    `sft_share` (a world of one: every share weighs 1), the code paths a rank of a distributed trainer runs on its
    part of the batch."""

    @abstractmethod
    def update_shares(
        self,
        batch: TrainBatch,
        old_logprobs: torch.Tensor,
        replay_ids: torch.Tensor | None,
        replay_pad: torch.Tensor | None,
        shares: Sequence[Share],
        *,
        clip_low: float,
        clip_high: float,
        importance_cap: float | None = None,
        clip_ratio_c: float | None = None,
    ) -> list[ShareStats]:
        """One optimizer step per share of this process's rows (`hf_policy`, `megatron/adapter`)."""

    @abstractmethod
    def sft_share(
        self,
        prompts: Sequence[Sequence[int]],
        answers: Sequence[Sequence[int]],
        *,
        total_tokens: int | None,
        world: int = 1,
        padding: bool = False,
    ) -> tuple[float, int]:
        """This rank's part of one SFT step: (its token-mean loss, its answer tokens). `total_tokens` (all ranks'
        answer tokens; None: this rank has them all) scales the loss as in `update_shares`."""

    def sft_step(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float:
        """One supervised step (cross-entropy on answer tokens), natural routing: the toy-task warm-up."""
        return self.sft_share(prompts, answers, total_tokens=None)[0]

    def update(
        self,
        batch: TrainBatch,
        old: OldPass,
        *,
        mini_batches: int,
        clip_low: float,
        clip_high: float,
        importance_cap: float | None = None,
        clip_ratio_c: float | None = None,
    ) -> UpdateStats:
        """PPO-clip over `mini_batch_rows` (strided) slices, one optimizer step each; replay (if any) through
        backward. With `importance_cap`, each token is weighted by its truncated pi_old / pi_rollout."""
        import torch

        (plan,) = update_plan(batch.response_mask.sum(dim=1).tolist(), mini_batches=mini_batches, world=1)
        idx = torch.as_tensor(plan.rows, dtype=torch.int64, device=old.logprobs.device)
        replay_ids = None if old.replay_ids is None else old.replay_ids[idx]
        replay_pad = None if old.replay_pad is None else old.replay_pad[idx]
        stats = self.update_shares(
            batch.select(plan.rows),
            old.logprobs[idx],
            replay_ids,
            replay_pad,
            plan.shares,
            clip_low=clip_low,
            clip_high=clip_high,
            importance_cap=importance_cap,
            clip_ratio_c=clip_ratio_c,
        )
        return combine_update([stats])
