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

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

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
from r3operator.trainer.grpo.loss import ppo_clip_loss, truncated_importance_weights
from r3operator.trainer.logprobs import token_logprobs
from r3operator.trainer.nonfinite import step_or_skip
from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay
from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, load_policy_state, policy_state
from r3operator.trainer.shards import Share, ShareStats, UpdateByShares
from r3operator.wire.weights import PackedChunk, packed_chunks


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
        """No-grad forward under the mode's routing; records natural and used ids."""
        import torch

        if mode is ReplayMode.R3 and batch.engine_routes is None:
            raise ValueError("R3 needs engine routes in the batch")
        natural = RouterRecorder(natural=True).install(self.model)
        used = RouterRecorder(natural=False).install(self.model)
        hook_calls = None
        try:
            with torch.no_grad(), self._compute():
                if mode is ReplayMode.R3:
                    with self.replay.armed(batch.engine_routes, padding_mask=batch.route_pad):
                        lp = token_logprobs(
                            self.model, batch.input_ids, batch.attention_mask, temperature=batch.temperature
                        )
                    hook_calls = {0: dict(self.replay.calls)}  # this process; a rank actor re-keys it
                else:
                    lp = token_logprobs(
                        self.model, batch.input_ids, batch.attention_mask, temperature=batch.temperature
                    )
            natural_ids, used_ids = self._stacked(natural, batch), self._stacked(used, batch)
        finally:
            natural.remove()
            used.remove()
        return old_pass_for(mode, batch, lp, natural_ids, used_ids, hook_calls=hook_calls)

    def update_shares(
        self,
        batch: TrainBatch,
        old_logprobs: Any,
        replay_ids: Any,
        replay_pad: Any,
        shares: Sequence[Share],
        *,
        clip_low: float,
        clip_high: float,
        importance_cap: float | None = None,
        clip_ratio_c: float | None = None,
    ) -> list[ShareStats]:
        """One optimizer step per share (this rank's part of one mini-batch). `batch`, `old_logprobs`
        and the replay ids hold this rank's rows only; a share's loss is scaled by its weight so that the
        ranks' averaged gradients are the whole mini-batch's (trainer/shards.py)."""
        import torch

        self.model.train()
        out = []
        for share in shares:
            mb = batch.select(share.rows)
            idx = torch.as_tensor(share.rows, dtype=torch.int64, device=old_logprobs.device)
            self.optimizer.zero_grad(set_to_none=True)
            if replay_ids is not None:
                pad = None if replay_pad is None else replay_pad[idx]
                self.replay.arm(replay_ids[idx], padding_mask=pad)
            try:
                old_lp, weights, iw = old_logprobs[idx], None, None
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
                (loss if share.weight == 1.0 else loss * share.weight).backward()
            finally:
                self.replay.disarm()
            norm = _scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM))
            value = float(loss.detach())
            applied = step_or_skip(self.optimizer, value, norm, what="update")
            tokens = 0 if share.padding else int(mb.response_mask.sum())
            nan = float("nan")
            out.append(
                ShareStats(
                    value,
                    stats.clip_fraction,
                    stats.approx_kl,
                    tokens,
                    norm,
                    importance_weight_mean=iw.weight_mean if iw is not None else nan,
                    importance_truncated_fraction=iw.truncated_fraction if iw is not None else nan,
                    applied=applied,
                )
            )
        self.model.eval()
        return out

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
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self._compute():
            lp = token_logprobs(self.model, ids, attn)
        loss = -(lp * mask).sum() / mask.sum()
        weight = 0.0 if padding else 1.0 if total_tokens is None else tokens / max(total_tokens, 1) * world
        (loss if weight == 1.0 else loss * weight).backward()
        norm = _scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM))
        value = float(loss.detach())
        step_or_skip(self.optimizer, value, norm, what="SFT warm-up")
        self.model.eval()
        return value, 0 if padding else tokens

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        """fp32 greedy decode (no autocast) with natural routing, full re-forward per token (diagnostics)."""
        return greedy_decode(self.canary_logits, prompts, max_tokens=max_tokens, eos_id=self.eos_id)

    def canary_logits(self, sequence: Sequence[int]) -> Any:
        """[len(sequence), V] fp32 next-token logits, fp32 weights, no autocast, natural routing."""
        import torch

        ids = torch.as_tensor([list(sequence)], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()

    def canary_forward(
        self, sequence: Sequence[int], routes: Any, route_pad: Any, *, compute: bool = False
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

    def weight_chunks(self, *, chunk_size_mb: int, dtype: Any) -> Iterator[PackedChunk]:
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


def _scalar(value: Any) -> float:
    """A float from a tensor that may be an FSDP2 DTensor (clip_grad_norm_ returns a replicated one)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
