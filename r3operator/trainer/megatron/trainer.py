"""Megatron trainer backend: GPTModel (local spec) from the HF reference checkpoint, replayed logprobs,
a forward/backward step with a caller-supplied loss, and weights back in HF names for vLLM sync.

Micro-batch schedule (pipeline size 1): every micro-batch runs forward -> REPLAY_BACKWARD -> loss ->
backward, all inside one `replay_schedule()` (clear before / after), like Megatron's
`forward_backward_no_pipelining` (whose CUDA-only token counter keeps it off CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from r3operator.trainer.logprobs import logprobs_from_logits
from r3operator.trainer.megatron.config import transformer_config
from r3operator.trainer.megatron.convert import (
    hf_to_megatron,
    join_shards,
    local_to_global_name,
    megatron_to_hf,
    shard_tensor,
)
from r3operator.trainer.megatron.norms import use_tagged_norms
from r3operator.trainer.megatron.parallel import ParallelSizes, init_parallel
from r3operator.trainer.replay.megatron import (
    MegatronReplayError,
    ParallelLayout,
    ReplayMode,
    ReplaySession,
    adopt_layer_numbers,
    check_replay_config,
    replay_schedule,
)

Mode = Literal["off", "R3", "R2"]
LossFn = Callable[[Any, Any], tuple[Any, dict[str, float]]]  # (logprobs [b, S-1], micro-batch) -> (loss, stats)


@dataclass
class LogprobOutput:
    logprobs: Any  # [B, S-1] fp32 on CPU
    recorded: Any | None  # [B, S, L, K] int64 natural routes (R2 record / diagnostics); dense layers 0
    used: Any | None  # [B, S, L, K] ids the MoE dispatch received (from routing_map); dense layers 0


class MegatronTrainer:
    def __init__(self, hf_config: Any, model: Any, tconfig: Any, sizes: ParallelSizes, device: str, lr: float) -> None:
        import torch

        self.hf_config, self.model, self.tconfig, self.sizes, self.device = hf_config, model, tconfig, sizes, device
        self.num_layers = int(hf_config.num_hidden_layers)
        self.top_k = int(hf_config.num_experts_per_tok)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        from megatron.core import parallel_state as ps

        self.layout = ParallelLayout(
            tp_size=sizes.tp, tp_rank=ps.get_tensor_model_parallel_rank(), sequence_parallel=sizes.sequence_parallel,
            first_pp_stage=ps.is_pipeline_first_stage(),
        )  # fmt: skip
        self.session = ReplaySession(self.layout, num_experts=int(hf_config.num_experts), num_layers=self.num_layers)
        self.micro_batch_size: int | None = None

    # -- forward ------------------------------------------------------------------------------------------
    def _pad_seq(self, ids: Any, attn: Any, *extra: Any) -> tuple[Any, ...]:
        """Right-pad the sequence to a multiple of TP when sequence parallel slices it."""
        import torch.nn.functional as F

        mult = self.sizes.tp if self.sizes.sequence_parallel else 1
        pad = (-ids.shape[1]) % mult
        if not pad:
            return (ids, attn, *extra)
        out = [F.pad(ids, (0, pad)), F.pad(attn, (0, pad))]
        for t in extra:
            if t is None:
                out.append(None)
            elif t.dim() == 4:  # routes [B, S, L, K]: the pad rows are flagged in the mask below
                out.append(F.pad(t, (0, 0, 0, 0, 0, pad)))
            else:  # route padding mask [B, S]
                out.append(F.pad(t, (0, pad), value=True))
        return tuple(out)

    def _forward(self, mode: ReplayMode, ids: Any, attn: Any, routes: Any, route_pad: Any) -> Any:
        """Logits [B, S, V] of one right-padded micro-batch (`trainer.batch`: RoPE positions are the column
        indices, as in vLLM) with the replay state set for `mode`."""
        import torch

        s = ids.shape[1]
        ids, attn, routes, route_pad = self._pad_seq(ids, attn, routes, route_pad)
        if routes is not None and route_pad is None:
            route_pad = torch.zeros(routes.shape[:2], dtype=torch.bool)
        if route_pad is not None:  # attention padding never has a route either
            route_pad = route_pad.bool() | ~attn.bool().to(route_pad.device)
        dev = self.device
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        n = ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)
        mask = causal[None, None] | ~attn.bool()[:, None, None, :]  # True = masked out
        pad_mask = self.session.before_forward(
            mode, None if routes is None else routes.to(dev), None if route_pad is None else route_pad.to(dev)
        )
        logits = self.model(ids, pos, mask, padding_mask=pad_mask, runtime_gather_output=True)
        self.session.after_forward(mode)
        self._last_layout = (n, s)
        return logits[:, :s]

    def _split(self, b: int) -> list[Any]:
        import torch

        size = self.micro_batch_size or b
        return [torch.arange(i, min(i + size, b)) for i in range(0, b, size)]

    def logprobs(self, batch: Any, routes: Any | None = None, replay_mode: Mode = "off", *,
                 probe: bool = False) -> LogprobOutput:  # fmt: skip
        """No-grad [B, S-1] logprobs of a `TrainBatch`. R3: replay `routes` (engine routes [B, S, L, K]; rows
        flagged in `batch.route_pad` route naturally); R2: route naturally and RECORD (R2 never consumes
        rollout routes); off: natural routing. `probe=True` also returns the ids the dispatcher received
        (routing_map)."""
        import torch

        if replay_mode == "R2" and routes is not None:
            raise MegatronReplayError("R2 records the trainer's own routes; it must not be given rollout routes")
        if replay_mode == "R3" and routes is None:
            raise MegatronReplayError("R3 needs the rollout's routes")
        pad = batch.route_pad if routes is not None else None
        mode: ReplayMode = {"off": "off", "R3": "R3", "R2": "R2-record"}[replay_mode]
        self.model.eval()
        outs, recs, used = [], [], []
        with replay_schedule(), torch.no_grad(), RoutingProbe(self.model, enabled=probe) as rp:
            for rows in self._split(batch.input_ids.shape[0]):
                ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
                logits = self._forward(mode, ids, attn, None if routes is None else routes[rows],
                                       None if pad is None else pad[rows])  # fmt: skip
                outs.append(logprobs_from_logits(logits[:, :-1], ids[:, 1:].to(logits.device)).cpu())
                if mode == "R2-record":
                    recs.append(self._to_batch_layout(self.session.recorded(ids.shape[0], self._local_seq())))
                if probe:
                    used.append(self._to_batch_layout(rp.take(ids.shape[0], self._local_seq())))
        return LogprobOutput(torch.cat(outs), torch.cat(recs)[:, : batch.input_ids.shape[1]] if recs else None,
                             torch.cat(used)[:, : batch.input_ids.shape[1]] if used else None)  # fmt: skip

    def _local_seq(self) -> int:
        n = self._last_layout[0]
        return n // self.sizes.tp if self.sizes.sequence_parallel else n

    def _to_batch_layout(self, local: Any) -> Any:
        """Router-side [B, S_local, L_local, K] -> the caller's [B, S, L, K]: SP all-gather, drop the SP
        pad, global layers (dense 0)."""
        import torch

        _n, s = self._last_layout
        if self.sizes.sequence_parallel and self.sizes.tp > 1:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            parts = [torch.empty_like(local) for _ in range(self.sizes.tp)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            local = torch.cat(parts, dim=1)
        return self._scatter_layers(local[:, :s].cpu())

    def _scatter_layers(self, local: Any) -> Any:
        """[B, S, L_local, K] in instance order -> [B, S, L, K] by global layer (dense layers 0)."""
        import torch

        out = torch.zeros(*local.shape[:2], self.num_layers, local.shape[-1], dtype=torch.int64)
        out[:, :, self.session.layers] = local.cpu()
        return out

    # -- training -----------------------------------------------------------------------------------------
    def train_step(self, batch: Any, routes: Any | None, loss_fn: LossFn, *, replay_mode: Mode | None = None,
                   grad_clip: float = 1.0) -> dict[str, float]:  # fmt: skip
        """One optimizer step over `batch` (split in micro-batches; `loss_fn` gets `batch.select(rows)`).
        `routes` ([B, S, L, K]) are replayed (R3: the engine's, rows flagged in `batch.route_pad` routing
        naturally; R2: those `logprobs(..., "R2")` recorded); None routes naturally."""
        import torch

        mode: ReplayMode = "off" if routes is None else ("R2-replay" if replay_mode == "R2" else "R3")
        pad = batch.route_pad if (routes is not None and mode == "R3") else None
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts = self._split(batch.input_ids.shape[0])
        stats: dict[str, float] = {}
        with replay_schedule():
            for rows in parts:
                ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
                logits = self._forward(mode, ids, attn, None if routes is None else routes[rows],
                                       None if pad is None else pad[rows])  # fmt: skip
                lp = logprobs_from_logits(logits[:, :-1], ids[:, 1:].to(logits.device))
                loss, mb_stats = loss_fn(lp, batch.select(rows.tolist()))
                (loss / len(parts)).backward()
                for k, v in mb_stats.items():
                    stats[k] = stats.get(k, 0.0) + float(v) / len(parts)
                stats["loss"] = stats.get("loss", 0.0) + float(loss.detach()) / len(parts)
        self._allreduce_sequence_parallel_grads()
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip))
        self.optimizer.step()
        self.model.eval()
        return stats

    def _allreduce_sequence_parallel_grads(self) -> None:
        """Norm/router weights see only this rank's sequence chunk under SP: sum their grads over TP."""
        if not (self.sizes.sequence_parallel and self.sizes.tp > 1):
            return
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        for p in self.model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())

    # -- weights ------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Any]:
        """Full HF-named state dict (transformers in-memory names, experts fused) on CPU, every rank."""
        full = gather_full_megatron(self.model, self.tconfig)
        return megatron_to_hf(full, self.hf_config)


class RoutingProbe:
    """Forward hooks on every TopKRouter: the routing_map the dispatcher receives, as sorted ids."""

    def __init__(self, model: Any, *, enabled: bool) -> None:
        self.model, self.enabled, self.maps, self.handles = model, enabled, [], []

    def __enter__(self) -> RoutingProbe:
        if self.enabled:
            from megatron.core.transformer.moe.router import TopKRouter

            for m in self.model.modules():
                if isinstance(m, TopKRouter):
                    self.handles.append(m.register_forward_hook(self._hook))
        return self

    def _hook(self, _m: Any, _a: Any, out: Any) -> None:
        self.maps.append(out[1].detach())

    def take(self, b: int, s: int) -> Any:
        import torch

        per_layer = []
        for rm in self.maps:
            k = int(rm[0].sum())
            ids = rm.nonzero()[:, 1].view(rm.shape[0], k)  # row-major nonzero: ascending ids per token
            per_layer.append(ids.view(s, b, k).transpose(0, 1))
        self.maps = []
        return torch.stack(per_layer, dim=2)

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()


def _shard_info(name: str, param: Any) -> tuple[int | None, int, int, Any]:
    from megatron.core import parallel_state as ps

    dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
    if "local_experts" in name:
        return (
            dim,
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(check_initialized=False),
        )
    return (
        dim,
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def _offsets(model: Any, tconfig: Any) -> tuple[int, int]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    local_experts = tconfig.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return get_transformer_layer_offset(tconfig), ps.get_expert_model_parallel_rank() * local_experts


def load_hf_weights(model: Any, tconfig: Any, hf_sd: dict[str, Any], hf_config: Any) -> None:
    import torch

    full = hf_to_megatron(hf_sd, hf_config)
    layer_off, expert_off = _offsets(model, tconfig)
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = full[local_to_global_name(name, layer_offset=layer_off, expert_offset=expert_off)]
            dim, size, rank, _ = _shard_info(name, p)
            t = shard_tensor(name, src, partition_dim=dim, tp=size, rank=rank)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: converted shape {tuple(t.shape)} != parameter {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def gather_full_megatron(model: Any, tconfig: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    layer_off, expert_off = _offsets(model, tconfig)
    local: dict[str, Any] = {}
    for name, p in model.named_parameters():
        dim, size, _rank, group = _shard_info(name, p)
        t = p.detach()
        if dim is not None and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = join_shards(name, parts, partition_dim=dim)
        local[local_to_global_name(name, layer_offset=layer_off, expert_offset=expert_off)] = t.cpu()
    for group, size in (
        (ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()),
    ):
        if size > 1:  # small models only: objects through the group
            everything: list[Any] = [None] * size
            dist.all_gather_object(everything, local, group=group)
            local = {k: v for part in everything for k, v in part.items()}
    return local


def build_megatron_trainer(
    spec: Any | None,
    model_dir: str | Path,
    device: str = "cpu",
    *,
    dtype: Any = None,
    learning_rate: float = 1e-5,
    seed: int = 0,
    micro_batch_size: int | None = None,
) -> MegatronTrainer:
    """`spec`: the RLJob `trainer.megatron` block (MegatronSpec) or None (all sizes 1). fp32 by default."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
    sizes = ParallelSizes.from_spec(spec)
    if sizes.pp > 1:
        raise NotImplementedError(
            "trainer.megatron.pipelineParallelSize > 1: stage layer mapping is implemented and tested, the "
            "pipelined schedule is not wired in this backend yet"
        )
    hf_config = AutoConfig.from_pretrained(model_dir)
    tconfig = transformer_config(
        hf_config, sizes, dtype=dtype, device=device, router_fusion=bool(getattr(spec, "router_fusion", False)),
        recompute=bool(getattr(spec, "recompute", False)),
    )  # fmt: skip
    check_replay_config(tconfig)
    init_parallel(sizes, device, seed=seed)
    if ps.get_data_parallel_world_size() > 1:
        raise NotImplementedError("data parallel > 1 is not implemented in the Megatron backend (world = TP*PP*CP)")
    RouterReplay.clear_global_router_replay_instances()  # the instance list is process-global
    torch.manual_seed(seed)
    block_spec = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization="RMSNorm")
    if sizes.sequence_parallel:
        block_spec = use_tagged_norms(block_spec)  # torch norms refuse SP; MoE + TP needs SP to train
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=block_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(_theta(hf_config)),
        parallel_output=True,
    )
    adopt_layer_numbers(model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_hf_weights(model, tconfig, hf.state_dict(), hf_config)
    del hf
    model = model.to(device)
    trainer = MegatronTrainer(hf_config, model, tconfig, sizes, device, learning_rate)
    trainer.micro_batch_size = micro_batch_size
    return trainer


def _theta(hf_config: Any) -> float:
    from r3operator.trainer.megatron.config import rope_theta

    return rope_theta(hf_config)
