"""The policy trainer: HF Qwen3-MoE (fp32 master) with router replay, old-logprob pass and PPO-clip update.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.api.enums import ReplayMode
from r3operator.runtime.batch import TrainBatch
from r3operator.trainer.grpo.loss import ppo_clip_loss
from r3operator.trainer.logprobs import token_logprobs
from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay

GRAD_CLIP_NORM = 1.0


@dataclass
class OldPass:
    logprobs: Any  # [B, S-1] fp32
    natural_ids: Any  # [B, S, L, K]: what each router would pick on this forward
    used_ids: Any  # [B, S, L, K]: what the experts received (replayed ids under R3)
    replay_ids: Any | None  # what the update replays (engine routes for R3, natural_ids for R2)
    replay_pad: Any | None


@dataclass
class UpdateStats:
    loss: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    tokens: int


class PolicyTrainer:
    def __init__(
        self,
        model_dir: Path,
        *,
        device: str,
        learning_rate: float,
        seed: int,
        use_fsdp: bool = False,
        fsdp_options: dict[str, Any] | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.model.config.use_cache = False
        self.use_fsdp = use_fsdp
        if use_fsdp:
            from r3operator.trainer import fsdp

            fsdp.init_process_group_if_needed(device)
            self.model = fsdp.wrap_fsdp2(self.model, **(fsdp_options or {}))
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.eos_id = int(self.model.config.eos_token_id)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0)
        self.replay = RouterReplay().install(self.model)

    # -- passes -------------------------------------------------------------------------------------
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
            with torch.no_grad():
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
        return OldPass(lp, natural_ids, used_ids, replay_ids, replay_pad)

    def update(
        self, batch: TrainBatch, old: OldPass, *, mini_batches: int, clip_low: float, clip_high: float
    ) -> UpdateStats:
        """PPO-clip over `mini_batches` contiguous slices; replay (if any) armed through backward."""
        import torch

        self.model.train()
        n = batch.size
        slices = [list(range(n))[i::mini_batches] for i in range(mini_batches)]
        losses, clips, kls, norms, tokens = [], [], [], [], 0
        for rows in (r for r in slices if r):
            mb = batch.select(rows)
            idx = torch.as_tensor(rows, dtype=torch.int64)
            old_lp = old.logprobs[idx]
            self.optimizer.zero_grad(set_to_none=True)
            if old.replay_ids is not None:
                pad = None if old.replay_pad is None else old.replay_pad[idx]
                self.replay.arm(old.replay_ids[idx], padding_mask=pad)
            try:
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

        seqs = [list(p) + list(a) for p, a in zip(prompts, answers, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.int64)
        attn = torch.zeros_like(ids)
        mask = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
        for i, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
            ids[i, : len(seq)] = torch.as_tensor(seq)
            attn[i, : len(seq)] = 1
            mask[i, len(prompt) - 1 : len(seq) - 1] = True
        ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lp = token_logprobs(self.model, ids, attn)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM)
        self.optimizer.step()
        self.model.eval()
        return float(loss.detach())

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        """Greedy decode with natural routing, full re-forward per token (exact; cheap at toy sizes).

        Prompts of equal length are decoded as one batch (no padding, so nothing differs from a
        single-prompt forward); a row stops growing after <eos>.
        """
        import torch

        out: dict[int, list[int]] = {}
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        with torch.no_grad():
            for rows in by_len.values():
                ids = torch.as_tensor([list(prompts[i]) for i in rows], dtype=torch.int64, device=self.device)
                done = [False] * len(rows)
                for i in rows:
                    out[i] = []
                for _ in range(max_tokens):
                    logits = self.model(input_ids=ids, use_cache=False).logits[:, -1].float()
                    tokens = torch.argmax(logits, dim=-1)
                    for r, i in enumerate(rows):
                        if not done[r]:
                            out[i].append(int(tokens[r]))
                            done[r] = int(tokens[r]) == self.eos_id
                    if all(done):
                        break
                    ids = torch.cat([ids, tokens[:, None]], dim=1)
        return [out[i] for i in range(len(prompts))]

    # -- state --------------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        if self.use_fsdp:
            from r3operator.trainer import fsdp

            return fsdp.full_state_dict(self.model)
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
