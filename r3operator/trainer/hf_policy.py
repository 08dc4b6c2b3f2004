"""The policy trainer: HF Qwen3-MoE with router replay, old-logprob pass and PPO-clip update.

Numerics, like a production bf16 trainer: fp32 master weights and AdamW state; the old-logprob and
update forwards (and the SFT warm-up) run under `torch.autocast(device_type, dtype=bfloat16)` when
`compute_dtype` (RLJob `trainer.fsdp.paramDtype`, default bfloat16) is bfloat16, and under that autocast
every parameter is read at its bf16 value, the engine's (`bf16_params`: straight-through, the gradient
reaches the fp32 master). The weight-sync canary's forward (`canary_logits`) runs in fp32 WITHOUT
autocast, so against an fp32 engine it can demand exact greedy equality. On CUDA the FSDP2
MixedPrecisionPolicy keeps param_dtype fp32 for the same reason (bf16 compute comes from autocast and
`bf16_params`, not from FSDP's cast), see docs/runtime.md.

One process (FSDP2 over a group of one on CUDA), or one rank of `distributed.DistributedTrainer`
(FSDP2 over all ranks; `update_shares`/`sft_share` take the rank's part of the batch, `trainer/shards.py`).
Replay modes (spec.routingReplay.mode):

- R3: old-logprob pass and update replay the ENGINE's routes (from the routing store);
- R2: the old-logprob pass routes naturally and records the trainer's own choices (RouterRecorder),
  the update replays those; rollout routes are never consumed;
- Disabled: both passes route naturally.

In every mode the old-logprob pass also records, per token-layer, the router's natural choice and the
ids the experts actually received, for the routing-agreement metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r3operator.api.enums import ReplayMode
from r3operator.trainer import bf16_params
from r3operator.trainer.base import (
    GRAD_CLIP_NORM,
    CanaryForward,
    OldPass,
    compute_context,
    greedy_decode,
    old_pass_for,
)
from r3operator.trainer.batch import TrainBatch, sft_tensors
from r3operator.trainer.grpo.loss import ImportanceStats, LossStats, ppo_clip_loss, truncated_importance_weights
from r3operator.trainer.logprobs import token_logprobs
from r3operator.trainer.micro import micro_batches, micro_weights
from r3operator.trainer.nonfinite import step_or_skip
from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay
from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, load_policy_state, policy_state
from r3operator.trainer.shards import Share, ShareStats, UpdateByShares
from r3operator.wire.weights import PackedChunk, packed_chunks

if TYPE_CHECKING:  # pragma: no cover
    import torch


class PolicyTrainer(UpdateByShares):
    def __init__(
        self,
        model_dir: Path,
        *,
        device: str,
        learning_rate: float,
        seed: int,
        use_fsdp: bool = False,
        compute_dtype: str = "bfloat16",
        fsdp_options: dict[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        micro_batch_tokens: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"trainer.fsdp.paramDtype: expected bfloat16 or float32, got {compute_dtype!r}")
        torch.manual_seed(seed)
        self.device = device
        self.batch_device = device
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        self.compute_dtype = compute_dtype
        # transformers >= 4.56 / 5.x take `dtype=` (`torch_dtype=` is deprecated): fp32 master weights.
        # transformers types `PreTrainedModel.to` through a decorator that mypy reads as taking the model.
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)  # type: ignore[arg-type]
        self.model.config.use_cache = False
        if gradient_checkpointing:
            # `trainer.fsdp.gradientCheckpointing`: the update's backward recomputes each decoder layer (only
            # in train mode: the no-grad passes run as before). Non-reentrant, so the replay hooks run again
            # in the recompute and see the ids still armed (replay/hf.py); enabled before FSDP2 wraps layers.
            # transformers 5.24 renamed the call (the old name warns); our floor, 5.0, has only the old one.
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.micro_batch_tokens = micro_batch_tokens
        self.use_fsdp = use_fsdp
        if use_fsdp:
            from r3operator.trainer import fsdp

            fsdp.init_process_group_if_needed(device)
            # param_dtype fp32: the canary forward must see fp32 weights; bf16 compute comes from autocast.
            options = {**(fsdp_options or {}), "param_dtype": "float32"}
            self.model = fsdp.wrap_fsdp2(self.model, **options)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.eos_id = int(self.model.config.eos_token_id)
        if compute_dtype == "bfloat16":
            # After the wrap: the hooks go on the leaf modules, inside FSDP2's unshard/reshard.
            bf16_params.install(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0)
        self.replay = RouterReplay().install(self.model)
        self.checkpointer = ShardedCheckpointer()
        self.checkpointer.guard(self.optimizer)

    # -- passes -------------------------------------------------------------------------------------
    def _compute(self) -> Any:
        return compute_context(self.compute_dtype, self.device_type)

    def _stacked(self, recorder: RouterRecorder, batch: TrainBatch) -> Any:
        ids = recorder.stacked(self.num_layers)
        b, s = batch.input_ids.shape
        return ids.reshape(b, s, ids.shape[1], ids.shape[2])

    def old_logprobs(self, batch: TrainBatch, mode: ReplayMode) -> OldPass:
        """No-grad forward under the mode's routing, one micro-batch at a time; records natural and used ids,
        and each token's entropy (of the distribution the rollout sampled from, at its temperature)."""
        import torch

        if mode is ReplayMode.R3 and batch.engine_routes is None:
            raise ValueError("R3 needs engine routes in the batch")
        b, s = batch.input_ids.shape
        logprobs = torch.zeros((b, s - 1), dtype=torch.float32, device=batch.input_ids.device)
        entropy = torch.zeros_like(logprobs)
        natural_ids: Any = None
        used_ids: Any = None
        hook_calls: dict[int, int] = {}
        groups = micro_batches(batch.lengths, budget=self.micro_batch_tokens)
        for n in range(self._agreed_micro_batches(len(groups))):
            rows = groups[min(n, len(groups) - 1)]
            part = batch.select(rows).trimmed() if len(rows) < b else batch.trimmed()
            lp, ent, natural, used, calls = self._old_pass(part, mode)
            if calls is not None:  # summed over the micro-batches: a layer's hook ran in some forward or in none
                hook_calls = {layer: hook_calls.get(layer, 0) + n for layer, n in calls.items()}
            if n >= len(groups):
                continue  # a forward every FSDP2 rank must run; this rank had its rows already
            width = part.input_ids.shape[1]
            idx = torch.as_tensor(rows, dtype=torch.int64, device=logprobs.device)
            logprobs[idx, : width - 1] = lp
            entropy[idx, : width - 1] = ent
            if natural_ids is None:
                natural_ids = natural.new_zeros((b, s, *natural.shape[2:]))
                used_ids = used.new_zeros((b, s, *used.shape[2:]))
            natural_ids[idx, :width] = natural
            used_ids[idx, :width] = used
        # Pad columns hold nothing: 0, whatever width a micro-batch (or another rank) computed them at.
        pad = batch.attention_mask == 0
        logprobs[pad[:, 1:]] = 0.0
        entropy[pad[:, 1:]] = 0.0
        natural_ids[pad] = 0
        used_ids[pad] = 0
        old = old_pass_for(
            mode, batch, logprobs, natural_ids, used_ids, hook_calls={0: hook_calls} if mode is ReplayMode.R3 else None
        )
        old.entropy = entropy
        return old

    def _old_pass(self, part: TrainBatch, mode: ReplayMode) -> tuple[Any, Any, Any, Any, dict[int, int] | None]:
        """One micro-batch's (logprobs, entropy, natural ids, used ids, the replay hooks' runs per layer under R3),
        shaped as `part`; the hooks' count is this process's (a rank actor re-keys it)."""
        import torch

        natural = RouterRecorder(natural=True).install(self.model)
        used = RouterRecorder(natural=False).install(self.model)
        try:
            replay = (
                self.replay.armed(part.engine_routes, padding_mask=part.route_pad)
                if mode is ReplayMode.R3
                else nullcontext()
            )
            with torch.no_grad(), self._compute(), replay:
                lp, ent = token_logprobs(
                    self.model, part.input_ids, part.attention_mask, temperature=part.temperature, entropy=True
                )
            calls = dict(self.replay.calls) if mode is ReplayMode.R3 else None  # the hooks' runs on this forward
            return lp, ent, self._stacked(natural, part), self._stacked(used, part), calls
        finally:
            natural.remove()
            used.remove()

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
        """One optimizer step per share (this rank's part of one mini-batch), its rows in micro-batches of at
        most `micro_batch_tokens` (trainer/micro.py) whose gradients add up before the step. `batch`,
        `old_logprobs` and the replay ids hold this rank's rows only; a share's loss is scaled by its weight so
        that the ranks' averaged gradients are the whole mini-batch's (trainer/shards.py)."""
        import torch

        self.model.train()
        lengths, tokens = batch.lengths, [int(t) for t in batch.response_mask.sum(dim=1).tolist()]
        out = []
        for share in shares:
            self.optimizer.zero_grad(set_to_none=True)
            groups = micro_batches([lengths[i] for i in share.rows], budget=self.micro_batch_tokens)
            weights = micro_weights([tokens[i] for i in share.rows], groups)
            extra = self._agreed_micro_batches(len(groups)) - len(groups)
            groups, weights = groups + [groups[-1]] * extra, weights + [0.0] * extra  # forwards that add nothing
            parts = [
                self._micro_update(
                    batch,
                    [share.rows[i] for i in group],
                    old_logprobs,
                    replay_ids,
                    replay_pad,
                    weight=share.weight * weight,
                    clip_low=clip_low,
                    clip_high=clip_high,
                    importance_cap=importance_cap,
                    clip_ratio_c=clip_ratio_c,
                )
                for group, weight in zip(groups, weights, strict=True)
            ]
            norm = _scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM))
            stats = _share_stats(parts, weights, padding=share.padding, grad_norm=norm)
            applied = step_or_skip(self.optimizer, stats.loss, norm, what="update")
            out.append(dataclasses.replace(stats, applied=applied))
        self.model.eval()
        return out

    def _agreed_micro_batches(self, count: int) -> int:
        """The most micro-batches any rank has for this share: every rank runs as many forwards and backwards
        (each all-gathers FSDP2's shards), the ones beyond its own with weight 0."""
        import torch

        if not self.use_fsdp or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return count
        agreed = torch.tensor([count], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        return int(agreed.item())

    def _micro_update(
        self,
        batch: TrainBatch,
        rows: Sequence[int],
        old_logprobs: torch.Tensor,
        replay_ids: torch.Tensor | None,
        replay_pad: torch.Tensor | None,
        *,
        weight: float,
        clip_low: float,
        clip_high: float,
        importance_cap: float | None,
        clip_ratio_c: float | None,
    ) -> _MicroStats:
        """Forward and backward of one micro-batch, its token-mean loss scaled by `weight`."""
        import torch

        mb = batch.select(rows).trimmed()
        width = mb.input_ids.shape[1]
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=old_logprobs.device)
        if replay_ids is not None:
            pad = None if replay_pad is None else replay_pad[idx, :width]
            self.replay.arm(replay_ids[idx, :width], padding_mask=pad)
        try:
            old_lp, weights, iw = old_logprobs[idx, : width - 1], None, None
            if importance_cap is not None:
                weights, iw = truncated_importance_weights(
                    old_lp, mb.rollout_logprobs, mb.response_mask, cap=importance_cap
                )
            with self._compute():
                lp = token_logprobs(self.model, mb.input_ids, mb.attention_mask, temperature=mb.temperature)
            loss, stats = ppo_clip_loss(
                lp,
                old_lp,
                mb.advantages,
                mb.response_mask,
                clip_low=clip_low,
                clip_high=clip_high,
                importance_weights=weights,
                clip_ratio_c=clip_ratio_c,
            )
            (loss if weight == 1.0 else loss * weight).backward()
        finally:
            self.replay.disarm()
        return _MicroStats(float(loss.detach()), stats, iw, int(mb.response_mask.sum()))

    def sft_share(
        self,
        prompts: Sequence[Sequence[int]],
        answers: Sequence[Sequence[int]],
        *,
        total_tokens: int | None,
        world: int = 1,
        padding: bool = False,
    ) -> tuple[float, int]:
        """This rank's part of one SFT step: (its token-mean loss, its answer tokens). `total_tokens`
        (all ranks' answer tokens; None: this rank has them all) scales the loss as in `update_shares`."""
        import torch

        ids, attn, mask = sft_tensors(prompts, answers, pad_id=self.pad_id)
        ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
        tokens = int(mask.sum())
        lengths = [int(n) for n in attn.sum(dim=1).tolist()]
        groups = micro_batches(lengths, budget=self.micro_batch_tokens)
        shares = micro_weights([int(n) for n in mask.sum(dim=1).tolist()], groups)
        extra = self._agreed_micro_batches(len(groups)) - len(groups)
        groups, shares = groups + [groups[-1]] * extra, shares + [0.0] * extra  # forwards that add nothing
        weight = 0.0 if padding else 1.0 if total_tokens is None else tokens / max(total_tokens, 1) * world
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for group, share in zip(groups, shares, strict=True):
            rows = torch.as_tensor(group, dtype=torch.int64, device=ids.device)
            width = max(max(lengths[i] for i in group), 2)  # right padding: the columns after it are pad
            part_ids, part_attn, part_mask = ids[rows, :width], attn[rows, :width], mask[rows, : width - 1]
            with self._compute():
                lp = token_logprobs(self.model, part_ids, part_attn)
            loss = -(lp * part_mask).sum() / part_mask.sum().clamp(min=1)  # this micro-batch's token-mean
            (loss * (weight * share)).backward()
            value += float(loss.detach()) * share  # the step's token-mean, as one forward would report it
        norm = _scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM))
        step_or_skip(self.optimizer, value, norm, what="SFT warm-up")
        self.model.eval()
        return value, 0 if padding else tokens

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        """fp32 greedy decode (no autocast) with natural routing, full re-forward per token (diagnostics)."""
        return greedy_decode(self.canary_logits, prompts, max_tokens=max_tokens, eos_id=self.eos_id)

    def canary_logits(self, sequence: Sequence[int]) -> torch.Tensor:
        """[len(sequence), V] fp32 next-token logits, fp32 weights, no autocast, natural routing."""
        import torch

        ids = torch.as_tensor([list(sequence)], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()

    def canary_forward(
        self, sequence: Sequence[int], routes: torch.Tensor, route_pad: torch.Tensor, *, compute: bool = False
    ) -> CanaryForward:
        import torch

        ids = torch.as_tensor([list(sequence)], dtype=torch.int64, device=self.device)
        natural = RouterRecorder(natural=True).install(self.model)
        armed = self.replay.armed(routes.to(self.device), padding_mask=route_pad.to(self.device))
        try:
            with torch.no_grad(), armed, self._compute() if compute else nullcontext():
                logits = self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()
            natural_ids = natural.stacked(self.num_layers).cpu()
        finally:
            natural.remove()
        return CanaryForward(logits, natural_ids)

    # -- state --------------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        if self.use_fsdp:
            from r3operator.trainer import fsdp

            return fsdp.full_state_dict(self.model)
        return self.model.state_dict()

    def sync_state_dict(self) -> dict[str, Any]:
        """What the weight sync streams: the live (under FSDP2: sharded DTensor) tensors, on the device;
        `runtime.weights.checkpoint_tensors` gathers, casts and offloads them one at a time."""
        return self.model.state_dict()

    def optimizer_state_dict(self) -> dict[str, Any]:
        if self.use_fsdp:
            from r3operator.trainer import fsdp

            return fsdp.full_optimizer_state_dict(self.model, self.optimizer)
        return self.optimizer.state_dict()

    def load_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        self.checkpointer.wait_staged()  # the load overwrites the tensors a save in flight may still copy
        if self.use_fsdp:
            from r3operator.trainer import fsdp

            fsdp.load_full_state(self.model, self.optimizer, model_sd, optim_sd)
            return
        self.model.load_state_dict(model_sd)
        self.optimizer.load_state_dict(optim_sd)

    def weight_chunks(self, *, chunk_size_mb: int, dtype: torch.dtype | None) -> Iterator[PackedChunk]:
        return packed_chunks(self.sync_state_dict(), chunk_size_mb=chunk_size_mb, dtype=dtype)

    def save_checkpoint_async(self, directory: Path) -> None:
        self.checkpointer.save_async(directory, policy_state(self.model, self.optimizer))

    def wait_checkpoint_staged(self) -> None:
        """Block until the save in flight has copied the state (the next optimizer step waits for it anyway)."""
        self.checkpointer.wait_staged()

    def wait_checkpoint(self) -> None:
        self.checkpointer.wait()

    def load_checkpoint(self, directory: Path) -> None:
        self.checkpointer.wait()
        state = policy_state(self.model, self.optimizer)
        self.checkpointer.load(directory, state)
        load_policy_state(self.model, self.optimizer, state)

    def close(self) -> None:
        """Finish the save in flight and release the checkpoint's staging buffers."""
        self.checkpointer.close()


@dataclass(frozen=True)
class _MicroStats:
    loss: float  # the micro-batch's token-mean, unweighted
    stats: LossStats
    importance: ImportanceStats | None
    tokens: int


def _share_stats(
    parts: Sequence[_MicroStats], weights: Sequence[float], *, padding: bool, grad_norm: float
) -> ShareStats:
    """A share's figures from its micro-batches': token-weighted means (`weights` are their token shares), so
    they read as the one forward's would."""

    def mean(values: Sequence[float]) -> float:
        return sum(v * w for v, w in zip(values, weights, strict=True))

    nan = float("nan")
    has_importance = parts[0].importance is not None
    real = [p for p, w in zip(parts, weights, strict=True) if w > 0]
    return ShareStats(
        mean([p.loss for p in parts]),
        mean([p.stats.clip_fraction for p in parts]),
        mean([p.stats.approx_kl for p in parts]),
        0 if padding else sum(p.tokens for p in real),
        grad_norm,
        importance_weight_mean=mean([p.importance.weight_mean if p.importance else 0.0 for p in parts])
        if has_importance
        else nan,
        importance_truncated_fraction=mean([p.importance.truncated_fraction if p.importance else 0.0 for p in parts])
        if has_importance
        else nan,
        dual_clip_fraction=mean([p.stats.dual_clip_fraction for p in parts]),
    )


def _scalar(value: Any) -> float:
    """A float from a tensor that may be an FSDP2 DTensor (clip_grad_norm_ returns a replicated one)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
