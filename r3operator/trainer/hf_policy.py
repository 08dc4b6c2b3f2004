"""The policy trainer: HF Qwen3-MoE with router replay, old-logprob pass and PPO-clip update.

Numerics, like a production bf16 trainer: fp32 master weights and AdamW state; the old-logprob and
update forwards (and the SFT warm-up) run under `torch.autocast(device_type, dtype=bfloat16)` when
`compute_dtype` (RLJob `trainer.fsdp.paramDtype`, default bfloat16) is bfloat16. The weight-sync
canary's forward (`canary_logits`) runs in fp32 WITHOUT autocast, so against an fp32 engine it can
demand exact greedy equality. On CUDA the FSDP2 MixedPrecisionPolicy keeps param_dtype fp32 for the
same reason (bf16 compute comes from autocast, not from FSDP's cast), see docs/runtime.md.

Single process on CPU; FSDP2 (`r3operator.trainer.fsdp`) on CUDA. Replay modes (spec.routingReplay.mode):

- R3: old-logprob pass and update replay the ENGINE's routes (from the routing store);
- R2: the old-logprob pass routes naturally and records the trainer's own choices (RouterRecorder),
  the update replays those; rollout routes are never consumed;
- Disabled: both passes route naturally.

In every mode the old-logprob pass also records, per token-layer, the router's natural choice and the
ids the experts actually received, for the routing-agreement metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.api.enums import ReplayMode
from r3operator.trainer.base import (
    GRAD_CLIP_NORM,
    OldPass,
    UpdateStats,
    compute_context,
    greedy_decode,
    mini_batch_rows,
)
from r3operator.trainer.batch import TrainBatch, sft_tensors
from r3operator.trainer.grpo.loss import ppo_clip_loss
from r3operator.trainer.logprobs import token_logprobs
from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay


class PolicyTrainer:
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
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"trainer.fsdp.paramDtype: expected bfloat16 or float32, got {compute_dtype!r}")
        torch.manual_seed(seed)
        self.device = device
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        self.compute_dtype = compute_dtype
        # transformers >= 4.56 / 5.x take `dtype=` (`torch_dtype=` is deprecated): fp32 master weights.
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.model.config.use_cache = False
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
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0)
        self.replay = RouterReplay().install(self.model)

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
        try:
            with torch.no_grad(), self._compute():
                if mode is ReplayMode.R3:
                    with self.replay.armed(batch.engine_routes, padding_mask=batch.route_pad):
                        lp = token_logprobs(self.model, batch.input_ids, batch.attention_mask)
                else:
                    lp = token_logprobs(self.model, batch.input_ids, batch.attention_mask)
            natural_ids, used_ids = self._stacked(natural, batch), self._stacked(used, batch)
        finally:
            natural.remove()
            used.remove()
        if mode is ReplayMode.R3:
            replay_ids, replay_pad = batch.engine_routes, batch.route_pad
        elif mode is ReplayMode.R2:
            replay_ids, replay_pad = natural_ids, None  # every row recorded: replay all of them
        else:
            replay_ids = replay_pad = None
        return OldPass(lp, natural_ids, used_ids, replay_ids, replay_pad, mode)

    def update(
        self, batch: TrainBatch, old: OldPass, *, mini_batches: int, clip_low: float, clip_high: float
    ) -> UpdateStats:
        """PPO-clip over `mini_batch_rows` (strided) slices; replay (if any) armed through backward."""
        import torch

        self.model.train()
        losses, clips, kls, norms, tokens = [], [], [], [], 0
        for rows in mini_batch_rows(batch.size, mini_batches):
            mb = batch.select(rows)
            idx = torch.as_tensor(rows, dtype=torch.int64)
            old_lp = old.logprobs[idx]
            self.optimizer.zero_grad(set_to_none=True)
            if old.replay_ids is not None:
                pad = None if old.replay_pad is None else old.replay_pad[idx]
                self.replay.arm(old.replay_ids[idx], padding_mask=pad)
            try:
                with self._compute():
                    lp = token_logprobs(self.model, mb.input_ids, mb.attention_mask)
                loss, stats = ppo_clip_loss(
                    lp, old_lp, mb.advantages, mb.response_mask, clip_low=clip_low, clip_high=clip_high
                )
                loss.backward()
            finally:
                self.replay.disarm()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM)
            self.optimizer.step()
            losses.append(float(loss.detach()))
            clips.append(stats.clip_fraction)
            kls.append(stats.approx_kl)
            norms.append(float(norm))
            tokens += int(mb.response_mask.sum())
        self.model.eval()
        return UpdateStats(
            float(np.mean(losses)), float(np.mean(clips)), float(np.mean(kls)), float(np.mean(norms)), tokens
        )

    def sft_step(self, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float:
        """One supervised step (cross-entropy on answer tokens), natural routing: the toy-task warm-up."""
        import torch

        ids, attn, mask = sft_tensors(prompts, answers, pad_id=self.pad_id)
        ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self._compute():
            lp = token_logprobs(self.model, ids, attn)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM)
        self.optimizer.step()
        self.model.eval()
        return float(loss.detach())

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        """fp32 greedy decode (no autocast) with natural routing, full re-forward per token (diagnostics)."""
        return greedy_decode(self.canary_logits, prompts, max_tokens=max_tokens, eos_id=self.eos_id)

    def canary_logits(self, sequence: Sequence[int]) -> Any:
        """[len(sequence), V] fp32 next-token logits, fp32 weights, no autocast, natural routing."""
        import torch

        ids = torch.as_tensor([list(sequence)], dtype=torch.int64, device=self.device)
        with torch.no_grad():
            return self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()

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
        if self.use_fsdp:
            from r3operator.trainer import fsdp

            fsdp.load_full_state(self.model, self.optimizer, model_sd, optim_sd)
            return
        self.model.load_state_dict(model_sd)
        self.optimizer.load_state_dict(optim_sd)
