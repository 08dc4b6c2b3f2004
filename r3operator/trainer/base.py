"""What both trainer backends (HF/FSDP and Megatron) share: the old-logprob pass result, update
statistics, the autocast context, mini-batch slicing, greedy decoding, and the `Trainer` protocol the
driver talks to."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from r3operator.api.enums import ReplayMode
from r3operator.trainer.batch import TrainBatch

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from r3operator.wire.weights import PackedChunk

GRAD_CLIP_NORM = 1.0


@dataclass
class OldPass:
    logprobs: torch.Tensor  # [B, S-1] fp32
    natural_ids: torch.Tensor  # [B, S, L, K]: what each router would pick on this forward
    used_ids: torch.Tensor  # [B, S, L, K]: what the experts received (replayed ids under R3)
    replay_ids: torch.Tensor | None  # what the update replays (engine routes for R3, natural_ids for R2)
    replay_pad: torch.Tensor | None  # [B, S] bool: rows the update routes naturally
    mode: ReplayMode | None = None
    entropy: torch.Tensor | None = None  # [B, S-1] fp32 entropy of each next-token distribution; None: not computed
    hook_calls: dict[int, dict[int, int]] | None = None
    """R3: per trainer rank, per MoE layer it holds, how many times the replay hook ran in this pass (the
    step loop's hooks-not-fired check, routing/checks.py); None where the pass did not replay."""


def old_pass_for(
    mode: ReplayMode,
    batch: TrainBatch,
    logprobs: torch.Tensor,
    natural_ids: torch.Tensor,
    used_ids: torch.Tensor,
    *,
    hook_calls: dict[int, dict[int, int]] | None = None,
) -> OldPass:
    """The old-logprob pass result for `mode`: what the update replays (R3: the engine's routes; R2:
    the trainer's own natural choices, every real token; Disabled: nothing)."""
    if mode is ReplayMode.R3:
        replay_ids, replay_pad = batch.engine_routes, batch.route_pad
    elif mode is ReplayMode.R2:  # the pad routes naturally, as the engine's pad does under R3
        replay_ids, replay_pad = natural_ids, batch.attention_mask == 0
    else:
        replay_ids = replay_pad = None
    return OldPass(logprobs, natural_ids, used_ids, replay_ids, replay_pad, mode, hook_calls=hook_calls)


@dataclass
class CanaryForward:
    """The weight canary's trainer forward of one sequence with the engine's routes replayed."""

    logits: torch.Tensor  # [S, V] fp32 next-token logits
    natural_ids: torch.Tensor  # [S, L, K] what the trainer's routers would have chosen on that forward


@dataclass
class UpdateStats:
    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    tokens: int
    importance_weight_mean: float = float("nan")  # with importance_cap: mean truncated weight, else NaN
    importance_truncated_fraction: float = float("nan")
    dual_clip_fraction: float = float("nan")  # tokens whose loss the dual-clip bound replaced; NaN: not reported
    updates: int = 1  # optimizer steps attempted (one per mini-batch)
    updates_skipped: int = 0  # of those, skipped by the non-finite guard (trainer/nonfinite.py)

    @property
    def applied_any(self) -> bool:
        """Whether any mini-batch's optimizer step changed the weights."""
        return self.updates_skipped < self.updates


def compute_context(compute_dtype: str, device_type: str) -> AbstractContextManager[object]:
    """Autocast context of the training-side forwards (old-logprob, update, SFT): bf16 autocast when
    `compute_dtype` is bfloat16, none for float32. Shared by both trainer backends."""
    import torch

    if compute_dtype == "bfloat16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return nullcontext()


def mini_batch_rows(n: int, mini_batches: int) -> list[list[int]]:
    """The update's mini-batches over `n` rows: strided slices `i::mini_batches`, empty ones dropped."""
    return [rows for rows in (list(range(n))[i::mini_batches] for i in range(mini_batches)) if rows]


def greedy_decode(
    logits_fn: Callable[[Sequence[int]], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    eos_id: int,
) -> list[list[int]]:
    """Greedy continuation of each prompt with `logits_fn(sequence) -> [len, V]`; stops after <eos>."""
    out: list[list[int]] = []
    for prompt in prompts:
        seq, gen = list(prompt), []
        for _ in range(max_tokens):
            token = int(logits_fn(seq)[-1].argmax())
            gen.append(token)
            seq.append(token)
            if token == eos_id:
                break
        out.append(gen)
    return out


class Trainer(Protocol):
    """The policy trainer the driver steps: `hf_policy.PolicyTrainer` (HF/FSDP, one process), the Megatron
    adapter (one process) and `distributed.DistributedTrainer` (either backend over Ray-actor ranks)."""

    pad_id: int
    eos_id: int
    batch_device: str  # where the driver builds the step's TrainBatch

    def old_logprobs(self, batch: TrainBatch, mode: ReplayMode) -> OldPass: ...

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
        """`importance_cap`: weight each token by min(pi_old / pi_rollout, cap) (asynchronous mode);
        `clip_ratio_c`: the dual-clip bound of negative-advantage tokens (`grpo.loss.ppo_clip_loss`)."""
        ...

    def sft_step(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float: ...

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]: ...

    def canary_logits(self, sequence: Sequence[int]) -> torch.Tensor: ...

    def canary_forward(
        self, sequence: Sequence[int], routes: torch.Tensor, route_pad: torch.Tensor, *, compute: bool = False
    ) -> CanaryForward:
        """Logits of `sequence` with `routes` ([1, S, L, K]; rows flagged in `route_pad` [1, S] route
        naturally) replayed, and the routers' natural choices on the same forward. fp32 without autocast;
        `compute=True`: under the trainer's compute context (bf16 autocast by default), the precision of a
        bf16 engine."""
        ...

    def model_state_dict(self) -> dict[str, Any]: ...

    def sync_state_dict(self) -> dict[str, Any]: ...

    def optimizer_state_dict(self) -> dict[str, Any]: ...

    def load_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None: ...

    def weight_chunks(self, *, chunk_size_mb: int, dtype: torch.dtype | None) -> Iterator[PackedChunk]:
        """The current weights for the engines: checkpoint names, `dtype`, packed (wire/weights.py)."""
        ...

    def save_checkpoint_async(self, directory: Path) -> None:
        """Start writing model + optimizer state into `directory` (sharded, one file per rank); returns
        once the copy into host memory is enqueued. The trainer's next optimizer step (and any load) waits
        for that copy, so what follows the save (rollout, forward passes) overlaps with it and the write."""
        ...

    def wait_checkpoint(self) -> None:
        """Block until the save started last is on disk on every rank; raise its error."""
        ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def close(self) -> None:
        """Release what the trainer holds beyond this process (rank actors); a no-op otherwise."""
        ...
