"""The `r3operator.trainer.base.Trainer` protocol (which `hf_policy.PolicyTrainer` also implements) over
the Megatron backend (`trainer.backend: Megatron`).

Mapping (docs/megatron.md):

| runtime call | Megatron backend |
|---|---|
| `old_logprobs(batch, R3)` | `logprobs(batch, engine_routes, R3, probe=True)`; natural ids: extra `Disabled` pass |
| `old_logprobs(batch, R2)` | `logprobs(batch, None, R2, probe=True)`; `.recorded` is replayed by the update |
| `old_logprobs(batch, Disabled)` | `logprobs(batch, None, Disabled, probe=True)` |
| `update`, `update_shares` | per share (mini-batch) `train_step(mb, routes, PPO-clip, loss_scale=weight, row_tokens)` |
| `model_state_dict()` | `hf_state_dict()` (HF names; `runtime.weights` unfuses the experts) |
| `optimizer_state_dict`, `load_state` | AdamW state by full Megatron name (`optimizer_full_state`), any TP/EP |
| `sft_step`, `sft_share`, `canary_logits` | written here |
| `save_checkpoint_async`, `load_checkpoint` | DCP of that whole `{model, optimizer}`; every rank reads it back |

The same object is one rank of `distributed.DistributedTrainer` (`megatron/ranks.py`): `update_shares` and
`sft_share` then take its data-parallel replica's rows.

Numerics: fp32 parameters and AdamW state (the backend's default), forwards of the old-logprob pass, the
update and the SFT warm-up under bf16 autocast like the FSDP path, every parameter read at its bf16 value
there (`trainer.bf16_params`); the canary forward in fp32 without autocast. Under R3 the natural-routing
ids come from a separate no-replay forward (the HF path records them inside the replayed forward), so
`routing_natural_agreement` can differ slightly between backends.
"""

from __future__ import annotations

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
)
from r3operator.trainer.batch import TrainBatch, sft_tensors
from r3operator.trainer.grpo.loss import ppo_clip_loss, truncated_importance_weights
from r3operator.trainer.sharded_checkpoint import ShardedCheckpointer, read_full_state
from r3operator.trainer.shards import Share, ShareStats, UpdateByShares
from r3operator.wire.weights import PackedChunk, packed_chunks

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Any: Megatron-Core ships no type information: the Megatron trainer's objects (model, configs, local batches) are Any
# here.

MEGATRON_PACKAGE_HINT = (
    "megatron-core (pip install 'megatron-core==0.16.1' on Python < 3.12, 'megatron-core==0.19.2' on Python 3.12; "
    "extra `megatron`)"
)


class MegatronUnavailableError(RuntimeError):
    """`trainer.backend: Megatron` was asked for but megatron-core cannot be imported."""


@dataclass
class _PPOBatch(TrainBatch):
    old_logprobs: Any = None  # [B, S-1]: row-selected together with the batch by train_step

    def select(self, rows: Sequence[int]) -> _PPOBatch:
        import dataclasses

        import torch

        picked = [int(i) for i in rows]
        base = TrainBatch.select(self, picked)
        idx = torch.as_tensor(picked, dtype=torch.int64, device=self.old_logprobs.device)
        return _PPOBatch(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(TrainBatch)},
            old_logprobs=self.old_logprobs[idx],
        )


@dataclass
class _SFTBatch:
    input_ids: Any
    attention_mask: Any
    loss_mask: Any

    def select(self, rows: Sequence[int]) -> _SFTBatch:
        import torch

        idx = torch.as_tensor([int(i) for i in rows], dtype=torch.int64, device=self.input_ids.device)
        return _SFTBatch(self.input_ids[idx], self.attention_mask[idx], self.loss_mask[idx])


class MegatronPolicyTrainer(UpdateByShares):
    """`PolicyTrainer`'s interface on a `MegatronTrainer`."""

    def __init__(self, trainer: Any, *, compute_dtype: str = "bfloat16") -> None:
        self.mt = trainer
        self.device = trainer.device
        self.batch_device = str(trainer.device)
        self.checkpointer = ShardedCheckpointer()
        self.checkpointer.guard(trainer.optimizer)
        self.device_type = "cuda" if str(trainer.device).startswith("cuda") else "cpu"
        self.compute_dtype = compute_dtype
        if compute_dtype == "bfloat16":
            bf16_params.install(trainer.model)
        cfg = trainer.hf_config
        self.num_layers = int(cfg.num_hidden_layers)
        self.pad_id = int(getattr(cfg, "pad_token_id", None) or 0)
        self.eos_id = int(cfg.eos_token_id)

    def _compute(self) -> Any:
        return compute_context(self.compute_dtype, self.device_type)

    # -- passes -------------------------------------------------------------------------------------
    def old_logprobs(self, batch: TrainBatch, mode: ReplayMode) -> OldPass:
        """The backend returns CPU tensors; they go back to the batch's device for the metrics/update."""
        dev = batch.input_ids.device
        if mode is ReplayMode.R3:
            if batch.engine_routes is None:
                raise ValueError("R3 needs engine routes in the batch")
            with self._compute():
                out = self.mt.logprobs(batch, batch.engine_routes, ReplayMode.R3, probe=True)
                natural = self.mt.logprobs(batch, None, ReplayMode.DISABLED, probe=True).used
            calls = None if out.hook_calls is None else {0: out.hook_calls}  # this process; a rank actor re-keys it
            return OldPass(
                out.logprobs.to(dev),
                natural.to(dev),
                out.used.to(dev),
                batch.engine_routes,
                batch.route_pad,
                mode,
                hook_calls=calls,
            )
        if mode is ReplayMode.R2:
            with self._compute():
                out = self.mt.logprobs(batch, None, ReplayMode.R2, probe=True)
            recorded = out.recorded.to(dev)
            return OldPass(out.logprobs.to(dev), recorded, out.used.to(dev), recorded, None, mode)
        with self._compute():
            out = self.mt.logprobs(batch, None, ReplayMode.DISABLED, probe=True)
        used = out.used.to(dev)
        return OldPass(out.logprobs.to(dev), used, used, None, None, mode)

    def update_shares(
        self,
        batch: TrainBatch,
        old_logprobs: Any,
        replay_ids: torch.Tensor | None,
        replay_pad: torch.Tensor | None,
        shares: Sequence[Share],
        *,
        clip_low: float,
        clip_high: float,
        importance_cap: float | None = None,
        clip_ratio_c: float | None = None,
    ) -> list[ShareStats]:
        """One `train_step` per share (this data-parallel replica's part of one mini-batch), its loss scaled
        by the share's weight (trainer/shards.py; the DP mean happens in `megatron/grads.py`). Replay ids
        without a pad mask are R2's recorded routes (every row replays); with one, R3's engine routes."""
        import dataclasses

        import torch

        full = _PPOBatch(
            **{f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)}, old_logprobs=old_logprobs
        )
        replay_mode = ReplayMode.R2 if replay_ids is not None and replay_pad is None else None

        def loss_fn(lp: Any, mb: _PPOBatch) -> tuple[Any, dict[str, float]]:
            mask = mb.response_mask.to(lp.device)
            old_lp = mb.old_logprobs.to(lp.device)
            weights, extra = None, {}
            if importance_cap is not None:
                weights, iw = truncated_importance_weights(
                    old_lp, mb.rollout_logprobs.to(lp.device), mask, cap=importance_cap
                )
                extra = {
                    "importance_weight_mean": iw.weight_mean,
                    "importance_truncated_fraction": iw.truncated_fraction,
                }
            loss, stats = ppo_clip_loss(
                lp,
                old_lp,
                mb.advantages.to(lp.device),
                mask,
                clip_low=clip_low,
                clip_high=clip_high,
                importance_weights=weights,
                clip_ratio_c=clip_ratio_c,
            )
            return loss, {"clip_fraction": stats.clip_fraction, "approx_kl": stats.approx_kl, **extra}

        out = []
        for share in shares:
            mb = full.select(share.rows)
            routes = None if replay_ids is None else replay_ids[torch.as_tensor(share.rows)]
            with self._compute():
                r = self.mt.train_step(
                    mb,
                    routes,
                    loss_fn,
                    replay_mode=replay_mode,
                    grad_clip=GRAD_CLIP_NORM,
                    loss_scale=share.weight,
                    row_tokens=mb.response_mask.sum(dim=1).tolist(),
                )
            tokens = 0 if share.padding else int(mb.response_mask.sum())
            nan = float("nan")
            out.append(
                ShareStats(
                    r["loss"],
                    r["clip_fraction"],
                    r["approx_kl"],
                    tokens,
                    r["grad_norm"],
                    importance_weight_mean=r["importance_weight_mean"] if importance_cap is not None else nan,
                    importance_truncated_fraction=r["importance_truncated_fraction"]
                    if importance_cap is not None
                    else nan,
                    applied=bool(r["applied"]),
                )
            )
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
        """This data-parallel replica's part of one SFT step, weighted like `hf_policy.PolicyTrainer.sft_share`
        (`world`: the data-parallel size)."""
        ids, attn, mask = sft_tensors(prompts, answers, pad_id=self.pad_id)
        tokens = int(mask.sum())
        weight = 0.0 if padding else 1.0 if total_tokens is None else tokens / max(total_tokens, 1) * world

        def loss_fn(lp: Any, mb: _SFTBatch) -> tuple[Any, dict[str, float]]:
            m = mb.loss_mask.to(lp.device)
            return -(lp * m).sum() / m.sum().clamp(min=1), {}

        with self._compute():
            stats = self.mt.train_step(
                _SFTBatch(ids, attn, mask),
                None,
                loss_fn,
                grad_clip=GRAD_CLIP_NORM,
                loss_scale=weight,
                row_tokens=mask.sum(dim=1).tolist(),
            )
        return float(stats["loss"]), 0 if padding else tokens

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        return greedy_decode(self.canary_logits, prompts, max_tokens=max_tokens, eos_id=self.eos_id)

    def canary_logits(self, sequence: Sequence[int]) -> torch.Tensor:
        """[len, V] fp32 logits, fp32 weights, no autocast, natural routing (replay off)."""
        import torch

        from r3operator.trainer.replay.megatron import replay_schedule

        ids = torch.as_tensor([list(sequence)], dtype=torch.int64)
        self.mt.model.eval()
        with replay_schedule(), torch.no_grad():
            logits, _ = self.mt.forward_logits("off", ids, torch.ones_like(ids), None, None)
        return logits[0].float().cpu()

    def canary_forward(
        self, sequence: Sequence[int], routes: torch.Tensor, route_pad: torch.Tensor, *, compute: bool = False
    ) -> CanaryForward:
        """The replayed forward, then a natural one under the routing probe (the HF path records the natural
        choices inside its replayed forward; Megatron's replay replaces the router's top-k)."""
        import torch

        from r3operator.trainer.replay.megatron import replay_schedule

        ids = torch.as_tensor([list(sequence)], dtype=torch.int64)
        attn = torch.ones_like(ids)
        self.mt.model.eval()
        with torch.no_grad():
            with replay_schedule(), self._compute() if compute else nullcontext():
                logits, _ = self.mt.forward_logits("R3", ids, attn, routes, route_pad)
            with replay_schedule():
                _, natural = self.mt.forward_logits("off", ids, attn, None, None, probe=True)
        return CanaryForward(logits[0].float().cpu(), natural[0, : ids.shape[1]])

    # -- state --------------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Any]:
        return self.mt.hf_state_dict()

    def sync_state_dict(self) -> dict[str, Any]:
        return self.mt.hf_state_dict()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """AdamW state by full Megatron parameter name (`trainer.optimizer_full_state`): whole on every
        rank, so a checkpoint loads under other TP/EP sizes too."""
        from r3operator.trainer.megatron.trainer import optimizer_full_state

        return optimizer_full_state(self.mt.model, self.mt.tconfig, self.mt.optimizer)

    def load_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        from r3operator.trainer.megatron.trainer import load_hf_weights, load_optimizer_full_state

        self.checkpointer.wait_staged()  # the load overwrites the tensors a save in flight may still copy
        load_hf_weights(self.mt.model, self.mt.tconfig, model_sd, self.mt.hf_config)
        load_optimizer_full_state(self.mt.model, self.mt.tconfig, self.mt.optimizer, optim_sd)

    def weight_chunks(self, *, chunk_size_mb: int, dtype: torch.dtype | None) -> Iterator[PackedChunk]:
        return packed_chunks(self.sync_state_dict(), chunk_size_mb=chunk_size_mb, dtype=dtype)

    def save_checkpoint_async(self, directory: Path) -> None:
        state = {"model": self.model_state_dict(), "optimizer": self.optimizer_state_dict()}
        self.checkpointer.save_async(directory, state)

    def wait_checkpoint_staged(self) -> None:
        self.checkpointer.wait_staged()

    def wait_checkpoint(self) -> None:
        self.checkpointer.wait()

    def load_checkpoint(self, directory: Path) -> None:
        # Read whole (no template) on every rank: the state is kept whole, and each rank takes its shards.
        self.checkpointer.wait()
        state = read_full_state(directory)
        self.load_state(state["model"], state["optimizer"])

    def close(self) -> None:
        """Finish the save in flight and release the checkpoint's staging buffers."""
        self.checkpointer.close()


def require_megatron() -> None:
    """Raise `MegatronUnavailableError` naming trainer.backend when megatron-core is not importable."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise MegatronUnavailableError(
            f"spec.trainer.backend is Megatron, but megatron-core cannot be imported ({exc}). Install "
            f"{MEGATRON_PACKAGE_HINT}, or set trainer.backend: FSDP."
        ) from exc


def build_megatron_policy_trainer(spec: Any, model_dir: Path, *, device: str) -> MegatronPolicyTrainer:
    """`spec` is the RLJob spec; the trainer in this process (a world of one)."""
    require_megatron()
    from r3operator.trainer.megatron.trainer import build_megatron_trainer

    megatron = spec.trainer.megatron
    trainer = build_megatron_trainer(
        megatron,
        model_dir,
        device,
        learning_rate=spec.algorithm.learning_rate,
        seed=spec.seed,
        micro_batch_size=None if megatron is None else megatron.micro_batch_size,
    )
    return MegatronPolicyTrainer(trainer)
