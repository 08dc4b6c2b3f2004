"""Megatron trainer backend: GPTModel (local spec) from the HF reference checkpoint, replayed logprobs,
a forward/backward step with a caller-supplied loss, and weights back in HF names for vLLM sync.

Micro-batch schedule: `pipeline.py`'s 1F1B over the pipeline stages, all micro-batches inside one
`replay_schedule()` (clear before / after). Each stage arms its own routers per micro-batch
(`ReplaySession.before_forward`, REPLAY_BACKWARD after the forward) and runs its backwards in forward
order. With one stage that is forward -> REPLAY_BACKWARD -> loss -> backward per micro-batch, like
Megatron's `forward_backward_no_pipelining` (whose CUDA-only token counter keeps it off CPU). The last
stage computes logprobs and the loss; the old-logprob pass, its recorded / probed routes and the update's
statistics are then shared over the pipeline group, so every rank returns the whole answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from r3operator.api.enums import ReplayMode
from r3operator.trainer.logprobs import logprobs_from_logits
from r3operator.trainer.megatron.config import transformer_config
from r3operator.trainer.megatron.convert import (
    hf_to_megatron,
    join_shards,
    local_to_global_name,
    megatron_to_hf,
    shard_tensor,
)
from r3operator.trainer.megatron.grads import clip_global_grad_norm, finalize_grads
from r3operator.trainer.megatron.norms import use_tagged_norms
from r3operator.trainer.megatron.parallel import ParallelSizes, check_world, init_parallel
from r3operator.trainer.megatron.pipeline import Stage, StageLink, run_forward_only, run_one_f_one_b
from r3operator.trainer.nonfinite import step_or_skip
from r3operator.trainer.replay.megatron import (
    MegatronReplayError,
    ParallelLayout,
    ReplaySession,
    RouterAction,
    adopt_layer_numbers,
    check_replay_config,
    replay_schedule,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.utils.hooks

# Any: Megatron-Core ships no type information (pyproject.toml's mypy overrides): its models, optimizers, process
# groups and the tensors they hand back are Any here.

# The routers' action in a no-grad pass of each replay mode: R2 records there (and replays in the update's).
_NO_GRAD_ACTION: dict[ReplayMode, RouterAction] = {
    ReplayMode.DISABLED: "off",
    ReplayMode.R3: "R3",
    ReplayMode.R2: "R2-record",
}
LossFn = Callable[[Any, Any], tuple[Any, dict[str, float]]]  # (logprobs [b, S-1], micro-batch) -> (loss, stats)


@dataclass
class LogprobOutput:
    logprobs: Any  # [B, S-1] fp32 on CPU
    recorded: Any | None  # [B, S, L, K] int64 natural routes (R2 record / diagnostics); dense layers 0
    used: Any | None  # [B, S, L, K] ids the MoE dispatch received (from routing_map); dense layers 0
    hook_calls: dict[int, int] | None = None  # R3: per MoE layer (every stage's), forwards that replayed


class MegatronTrainer:
    def __init__(self, hf_config: Any, model: Any, tconfig: Any, sizes: ParallelSizes, device: str, lr: float) -> None:
        import torch

        self.hf_config, self.model, self.tconfig, self.sizes, self.device = hf_config, model, tconfig, sizes, device
        self.num_layers = int(hf_config.num_hidden_layers)
        self.top_k = int(hf_config.num_experts_per_tok)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        from megatron.core import parallel_state as ps

        self.layout = ParallelLayout(
            tp_size=sizes.tp,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            sequence_parallel=sizes.sequence_parallel,
            first_pp_stage=ps.is_pipeline_first_stage(),
        )
        self.session = ReplaySession(self.layout, num_experts=int(hf_config.num_experts), num_layers=self.num_layers)
        self.micro_batch_size: int | None = None
        self.stage = Stage.current()
        self.link = StageLink(self.stage, device, tconfig.pipeline_dtype or tconfig.params_dtype)

    # -- forward ------------------------------------------------------------------------------------------
    def _padded_shape(self, b: int, s: int) -> tuple[int, int]:
        """The micro-batch shape every rank of an expert-parallel (× expert-TP) group runs: its dispatcher
        gathers hidden states across the group, which cuts across data-parallel replicas holding different
        rows (the largest row count and width over all ranks; all ranks run their forwards in step). The
        width is a multiple of TP when sequence parallel slices it."""
        from megatron.core import parallel_state as ps

        if self.sizes.ep * self.sizes.etp > 1 and ps.get_data_parallel_world_size() > 1:
            import torch
            import torch.distributed as dist

            # Over this stage's data-parallel peers only: the other pipeline stages run their forwards of the
            # same micro-batch at other times, and reduce the same rows to the same shape themselves.
            shape = torch.tensor([b, s], dtype=torch.int64, device=self.device)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
            b, s = int(shape[0]), int(shape[1])
        mult = self.sizes.tp if self.sizes.sequence_parallel else 1
        return b, s + (-s) % mult

    def _pad_to(self, rows: int, cols: int, ids: Any, attn: Any, routes: Any, route_pad: Any) -> tuple[Any, ...]:
        """Right-pad columns (attention 0, no route) and append rows that attend to their first token
        only (a row with no key at all would give NaN attention); their logits are cut off again."""
        import torch.nn.functional as F

        dr, dc = rows - ids.shape[0], cols - ids.shape[1]
        if not (dr or dc):
            return ids, attn, routes, route_pad
        ids, attn = F.pad(ids, (0, dc, 0, dr)), F.pad(attn, (0, dc, 0, dr))
        if dr:
            attn[-dr:, 0] = 1
        if routes is not None:  # padded rows and columns are flagged in the mask: they route naturally
            routes = F.pad(routes, (0, 0, 0, 0, 0, dc, 0, dr))
            route_pad = F.pad(route_pad, (0, dc, 0, dr), value=True)
        return ids, attn, routes, route_pad

    def _activation_shape(self, padded: tuple[int, int]) -> tuple[int, int, int]:
        """[S', B', H] of the hidden states a stage passes on for a micro-batch padded to `padded` rows, cols
        (this TP rank's sequence chunk under sequence parallelism)."""
        rows, n = padded
        return (n // self.sizes.tp if self.sizes.sequence_parallel else n, rows, int(self.hf_config.hidden_size))

    def _forward(
        self,
        mode: RouterAction,
        ids: Any,
        attn: Any,
        routes: Any,
        route_pad: Any,
        received: Any = None,
        padded: tuple[int, int] | None = None,
    ) -> Any:
        """This stage's part of one right-padded micro-batch (`trainer.batch`: RoPE positions are the column
        indices, as in vLLM) with the replay state set for `mode`: logits [B, S, V] on the last stage, the
        hidden states to send on (`_activation_shape`) on the others. `received`: the previous stage's
        hidden states (None on the first stage); `padded`: the micro-batch's `_padded_shape`, when the
        caller agreed on it already."""
        import torch

        b, s = ids.shape
        if routes is not None and route_pad is None:
            route_pad = torch.zeros(routes.shape[:2], dtype=torch.bool)
        ids, attn, routes, route_pad = self._pad_to(*(padded or self._padded_shape(b, s)), ids, attn, routes, route_pad)
        if route_pad is not None:  # attention padding never has a route either
            route_pad = route_pad.bool() | ~attn.bool().to(route_pad.device)
        dev = self.device
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        rows, n = ids.shape
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)
        mask = causal[None, None] | ~attn.bool()[:, None, None, :]  # True = masked out
        pad_mask = self.session.before_forward(
            mode, None if routes is None else routes.to(dev), None if route_pad is None else route_pad.to(dev)
        )
        if not self.stage.first:
            self.model.set_input_tensor(received)
        out = self.model(ids, pos, mask, padding_mask=pad_mask, runtime_gather_output=True)
        self.session.after_forward(mode)
        self._last_layout = (rows, n, b, s)
        return out[:b, :s] if self.stage.last else out

    def forward_logits(
        self, mode: RouterAction, ids: Any, attn: Any, routes: Any, route_pad: Any, *, probe: bool = False
    ) -> tuple[Any, Any | None]:
        """One micro-batch through every stage without gradients (call inside `replay_schedule()` and
        `torch.no_grad()`): logits [B, S, V] on every rank, and with `probe` the ids the dispatchers
        received ([B, S, L, K], dense layers 0)."""
        used: list[Any] = []
        logits: list[Any] = []
        padded = self._padded_shape(*ids.shape)

        def forward(_i: int, received: Any) -> Any:
            out = self._forward(mode, ids, attn, routes, route_pad, received, padded)
            if probe:
                used.append(self._stage_ids(rp.take))
            if self.stage.last:
                logits.append(out)
            return out

        with RoutingProbe(self.model, enabled=probe) as rp:
            run_forward_only(1, self.link, forward, lambda _i: self._activation_shape(padded))
        b, s = ids.shape
        whole = self._from_last_stage(logits[0] if logits else None, (b, s, self._vocab()))
        return whole, (self._sum_over_stages(used[0]) if probe else None)

    def _vocab(self) -> int:
        return int(self.hf_config.vocab_size)

    def _from_last_stage(self, value: Any | None, shape: tuple[int, ...]) -> Any:
        """The last stage's tensor on every rank of the pipeline group (float32, on this rank's device)."""
        import torch
        import torch.distributed as dist

        if self.stage.size == 1:
            return value
        if self.stage.last:  # on the device: NCCL broadcasts device tensors only
            if value is None:
                raise RuntimeError("the last pipeline stage has no output to broadcast")
            buf = value.to(device=self.device, dtype=torch.float32).contiguous()
        else:
            buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.broadcast(buf, src=self.stage.last_rank, group=self.stage.group)
        return buf

    def _sum_over_stages(self, ids: Any) -> Any:
        """Per-layer ids each stage filled for its own layers (zeros elsewhere) -> every layer on every rank."""
        import torch.distributed as dist

        if self.stage.size == 1:
            return ids
        t = ids.to(self.device)
        dist.all_reduce(t, group=self.stage.group)
        return t.cpu()

    def _padded_shapes(self, parts: list[Any], width: int) -> list[tuple[int, int]]:
        """Every micro-batch's `_padded_shape`, agreed before the schedule: every stage needs it to size the
        activations it receives, and the agreement is a collective the stages must not interleave."""
        return [self._padded_shape(len(rows), width) for rows in parts]

    def _split(self, b: int) -> list[Any]:
        import torch

        size = self.micro_batch_size or b
        return [torch.arange(i, min(i + size, b)) for i in range(0, b, size)]

    def logprobs(
        self,
        batch: Any,
        routes: Any | None = None,
        replay_mode: ReplayMode = ReplayMode.DISABLED,
        *,
        probe: bool = False,
    ) -> LogprobOutput:
        """No-grad [B, S-1] logprobs of a `TrainBatch`. R3: replay `routes` (engine routes [B, S, L, K]; rows
        flagged in `batch.route_pad` route naturally); R2: route naturally and RECORD (R2 never consumes
        rollout routes); off: natural routing. `probe=True` also returns the ids the dispatcher received
        (routing_map)."""
        import torch

        if replay_mode is ReplayMode.R2 and routes is not None:
            raise MegatronReplayError("R2 records the trainer's own routes; it must not be given rollout routes")
        if replay_mode is ReplayMode.R3 and routes is None:
            raise MegatronReplayError("R3 needs the rollout's routes")
        pad = batch.route_pad if routes is not None else None
        mode = _NO_GRAD_ACTION[replay_mode]
        self.model.eval()
        temperature = float(getattr(batch, "temperature", 1.0))  # TrainBatch: the rollout's (batch.py)
        parts = self._split(batch.input_ids.shape[0])
        padded = self._padded_shapes(parts, batch.input_ids.shape[1])
        outs, recs, used = [], [], []
        self.session.reset_hook_calls()

        def forward(i: int, received: Any) -> Any:
            rows = parts[i]
            ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
            out = self._forward(
                mode,
                ids,
                attn,
                None if routes is None else routes[rows],
                None if pad is None else pad[rows],
                received,
                padded[i],
            )
            if self.stage.last:
                lp = logprobs_from_logits(out[:, :-1], ids[:, 1:].to(out.device), temperature=temperature)
                outs.append(lp.cpu())
            if mode == "R2-record":
                recs.append(self._stage_ids(self.session.recorded))
            if probe:
                used.append(self._stage_ids(rp.take))
            return out

        with replay_schedule(), torch.no_grad(), RoutingProbe(self.model, enabled=probe) as rp:
            run_forward_only(len(parts), self.link, forward, lambda i: self._activation_shape(padded[i]))
        b, s = batch.input_ids.shape
        logprobs = self._from_last_stage(torch.cat(outs) if outs else None, (b, s - 1)).cpu()
        return LogprobOutput(
            logprobs,
            self._sum_over_stages(torch.cat(recs)[:, :s]) if recs else None,
            self._sum_over_stages(torch.cat(used)[:, :s]) if used else None,
            self._hook_calls_over_stages() if mode == "R3" else None,
        )

    def _hook_calls_over_stages(self) -> dict[int, int]:
        """This stage's replay-hook counts, summed with every other stage's (each fills its own layers)."""
        import torch

        counts = torch.zeros(self.num_layers, dtype=torch.int64)
        mine = self.session.hook_calls()
        for layer, calls in mine.items():
            counts[layer] = calls
        held = torch.zeros(self.num_layers, dtype=torch.int64)
        held[list(mine)] = 1
        counts, held = self._sum_over_stages(counts), self._sum_over_stages(held)
        return {layer: int(counts[layer]) for layer in range(self.num_layers) if int(held[layer])}

    def _stage_ids(self, take: Callable[[int, int], Any]) -> Any:
        """The last forward's per-router ids on this stage (`take(rows, local seq)`: probed or recorded) in the
        caller's [B, S, L, K]; a stage without a router (only dense layers) contributes zeros."""
        import torch

        rows, seq = self._last_layout[0], self._local_seq()
        if not self.session.layers:
            return self._to_batch_layout(torch.zeros(rows, seq, 0, self.top_k, dtype=torch.int64, device=self.device))
        return self._to_batch_layout(take(rows, seq))

    def _local_seq(self) -> int:
        n = self._last_layout[1]
        return n // self.sizes.tp if self.sizes.sequence_parallel else n

    def _to_batch_layout(self, local: Any) -> Any:
        """Router-side [B, S_local, L_local, K] -> the caller's [B, S, L, K]: SP all-gather, drop the padded
        rows and columns, global layers (dense 0)."""
        import torch

        _rows, _n, b, s = self._last_layout
        if self.sizes.sequence_parallel and self.sizes.tp > 1:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            parts = [torch.empty_like(local) for _ in range(self.sizes.tp)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            local = torch.cat(parts, dim=1)
        return self._scatter_layers(local[:b, :s].cpu())

    def _scatter_layers(self, local: Any) -> Any:
        """[B, S, L_local, K] in instance order -> [B, S, L, K] by global layer (dense layers 0)."""
        import torch

        out = torch.zeros(*local.shape[:2], self.num_layers, local.shape[-1], dtype=torch.int64)
        out[:, :, self.session.layers] = local.cpu()
        return out

    # -- training -----------------------------------------------------------------------------------------
    def train_step(
        self,
        batch: Any,
        routes: Any | None,
        loss_fn: LossFn,
        *,
        replay_mode: ReplayMode | None = None,
        grad_clip: float = 1.0,
        loss_scale: float = 1.0,
        row_tokens: Any | None = None,
    ) -> dict[str, float]:
        """One optimizer step over `batch` (split in micro-batches; `loss_fn` gets `batch.select(rows)`).
        `routes` ([B, S, L, K]) are replayed (R3: the engine's, rows flagged in `batch.route_pad` routing
        naturally; R2: those `logprobs(..., "R2")` recorded); None routes naturally. `loss_scale`
        multiplies the loss that is differentiated (this data-parallel replica's share weight,
        `trainer/shards.py`); the reported loss is unscaled.

        `row_tokens` ([B], the loss tokens of each row) makes the step's loss the token-mean over the whole
        batch when `loss_fn` returns a token-mean: micro-batch i's loss weighs its tokens / the batch's
        tokens, so a token weighs the same whatever the lengths of the rows it shares a micro-batch with
        (`micro_batch_weights`). None: every micro-batch weighs 1 / their count (a per-row-mean loss)."""
        mode: RouterAction = "off" if routes is None else ("R2-replay" if replay_mode is ReplayMode.R2 else "R3")
        pad = batch.route_pad if (routes is not None and mode == "R3") else None
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        temperature = float(getattr(batch, "temperature", 1.0))  # an SFT batch has none: 1
        parts = self._split(batch.input_ids.shape[0])
        padded = self._padded_shapes(parts, batch.input_ids.shape[1])
        weights = micro_batch_weights(parts, row_tokens)
        stats: dict[str, float] = {}

        def forward(i: int, received: Any) -> Any:
            rows = parts[i]
            ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
            out = self._forward(
                mode,
                ids,
                attn,
                None if routes is None else routes[rows],
                None if pad is None else pad[rows],
                received,
                padded[i],
            )
            if not self.stage.last:
                return out
            lp = logprobs_from_logits(out[:, :-1], ids[:, 1:].to(out.device), temperature=temperature)
            loss, mb_stats = loss_fn(lp, batch.select(rows.tolist()))
            for k, v in mb_stats.items():
                stats[k] = stats.get(k, 0.0) + float(v) * weights[i]
            stats["loss"] = stats.get("loss", 0.0) + float(loss.detach()) * weights[i]
            return loss * (loss_scale * weights[i])

        with replay_schedule():
            run_one_f_one_b(len(parts), self.link, forward, lambda i: self._activation_shape(padded[i]))
        stats = self._stats_from_last_stage(stats)
        finalize_grads(self.model)
        stats["grad_norm"] = clip_global_grad_norm(self.model, grad_clip)
        loss = stats.get("loss", float("nan"))  # every rank has it (_stats_from_last_stage)
        stats["applied"] = float(step_or_skip(self.optimizer, loss, stats["grad_norm"], what="Megatron train step"))
        self.model.eval()
        return stats

    def _stats_from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        """The loss statistics (computed on the last stage) on every rank of the pipeline group."""
        import torch.distributed as dist

        if self.stage.size == 1:
            return stats
        box = [stats]
        dist.broadcast_object_list(box, src=self.stage.last_rank, group=self.stage.group)
        return dict(box[0])

    # -- weights ------------------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Any]:
        """Full HF-named state dict (transformers in-memory names, experts fused) on CPU, every rank."""
        full = gather_full_megatron(self.model, self.tconfig)
        return megatron_to_hf(full, self.hf_config)


def micro_batch_weights(parts: list[Any], row_tokens: Any | None) -> list[float]:
    """Each micro-batch's weight in the step's loss: its share of the loss tokens (`row_tokens[rows]`
    summed over the batch's), so that the sum of the micro-batches' weighted token-means is the token-mean
    over the whole batch. Equal weights without `row_tokens` or when the batch has no loss token."""
    if row_tokens is None:
        return [1.0 / len(parts)] * len(parts)
    counts = [float(sum(float(row_tokens[int(r)]) for r in rows)) for rows in parts]
    total = sum(counts)
    if total <= 0:
        return [1.0 / len(parts)] * len(parts)
    return [c / total for c in counts]


class RoutingProbe:
    """Forward hooks on every TopKRouter: the routing_map the dispatcher receives, as sorted ids."""

    def __init__(self, model: Any, *, enabled: bool) -> None:
        self.model, self.enabled = model, enabled
        self.maps: list[torch.Tensor] = []  # one routing_map [tokens, experts] per router call
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

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


def gather_full_megatron(model: Any, tconfig: Any, value: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Every parameter whole, in full Megatron names (global layers and experts, TP shards joined), on CPU
    on every rank. `value(param)` picks what is gathered (default: the parameter itself; AdamW moments
    have its shape and sharding)."""
    import torch
    import torch.distributed as dist

    layer_off, expert_off = _offsets(model, tconfig)
    local: dict[str, Any] = {}
    for name, p in model.named_parameters():
        dim, size, _rank, group = _shard_info(name, p)
        t = p.detach() if value is None else value(p)
        if dim is not None and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = join_shards(name, parts, partition_dim=dim)
        local[local_to_global_name(name, layer_offset=layer_off, expert_offset=expert_off)] = t.cpu()
    return merge_over_expert_and_pipeline(local)


def merge_over_expert_and_pipeline(local: dict[str, Any]) -> dict[str, Any]:
    """The union of the expert-parallel and pipeline peers' dicts (each holds other experts / layers)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for group, size in (
        (ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()),
    ):
        if size > 1:  # small models only: objects through the group
            everything: list[Any] = [None] * size
            dist.all_gather_object(everything, local, group=group)
            local = {k: v for part in everything for k, v in part.items()}
    return local


ADAM_SLOTS = ("exp_avg", "exp_avg_sq")


def optimizer_full_state(model: Any, tconfig: Any, optimizer: Any) -> dict[str, Any]:
    """AdamW's state like `gather_full_megatron`: per full Megatron name its step (0: no state yet) and
    whole moments; the same on every rank, and loadable under any TP/EP sizes (`load_optimizer_full_state`)."""
    import torch

    state = optimizer.state
    out: dict[str, Any] = {}
    for slot in ADAM_SLOTS:

        def moment(p: Any, slot: str = slot) -> Any:
            return state[p][slot].detach() if p in state else torch.zeros_like(p)

        out[slot] = gather_full_megatron(model, tconfig, moment)
    layer_off, expert_off = _offsets(model, tconfig)
    steps = {
        local_to_global_name(name, layer_offset=layer_off, expert_offset=expert_off): torch.as_tensor(
            float(state[p]["step"]) if p in state else 0.0
        )
        for name, p in model.named_parameters()
    }
    out["step"] = merge_over_expert_and_pipeline(steps)
    out["param_groups"] = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return out


def load_optimizer_full_state(model: Any, tconfig: Any, optimizer: Any, full: dict[str, Any]) -> None:
    """Put `optimizer_full_state`'s output back: each parameter takes its shard of the moments."""
    import torch

    layer_off, expert_off = _offsets(model, tconfig)
    for name, p in model.named_parameters():
        key = local_to_global_name(name, layer_offset=layer_off, expert_offset=expert_off)
        step = float(full["step"][key])
        if not step:
            optimizer.state.pop(p, None)
            continue
        dim, size, rank, _ = _shard_info(name, p)
        entry = {"step": torch.tensor(step, dtype=torch.float32)}
        for slot in ADAM_SLOTS:
            t = shard_tensor(name, full[slot][key], partition_dim=dim, tp=size, rank=rank)
            entry[slot] = t.to(device=p.device, dtype=p.dtype).clone()
        optimizer.state[p] = entry
    for group, saved in zip(optimizer.param_groups, full["param_groups"], strict=True):
        group.update(saved)


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
    hf_config = AutoConfig.from_pretrained(model_dir)
    check_world(
        sizes,
        _world_size(),
        num_experts=int(hf_config.num_experts),
        num_layers=int(hf_config.num_hidden_layers),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
    tconfig = transformer_config(
        hf_config,
        sizes,
        dtype=dtype,
        device=device,
        router_fusion=bool(getattr(spec, "router_fusion", False)),
        recompute=bool(getattr(spec, "recompute", False)),
    )
    check_replay_config(tconfig)
    init_parallel(sizes, device, seed=seed)
    if micro_batch_size is not None and sizes.ep * sizes.etp > 1 and ps.get_data_parallel_world_size() > 1:
        # The expert-parallel group spans replicas whose shares have different row counts: their micro-batch
        # counts would differ, and a forward one replica runs alone would wait in the dispatcher's gather.
        raise ValueError(
            "micro_batch_size with trainer.megatron.expertParallelSize > 1 across data-parallel "
            "replicas: leave it unset (one micro-batch per share)"
        )
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
    tag_tensor_parallel(model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_hf_weights(model, tconfig, hf.state_dict(), hf_config)
    del hf
    model = model.to(device)
    trainer = MegatronTrainer(hf_config, model, tconfig, sizes, device, learning_rate)
    trainer.micro_batch_size = micro_batch_size
    return trainer


def tag_tensor_parallel(model: Any) -> None:
    """Give every TP-parallel weight megatron's `tensor_model_parallel` / `partition_dim` tags. megatron-core
    0.16 sets them only inside its own weight initialisation, which this backend skips (the weights come
    from the HF checkpoint); weight loading, gathering and the gradient norm read them. Tags megatron set
    itself are kept."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def _world_size() -> int:
    """The process group's size, or the one `init_parallel` is about to join (env://, else 1)."""
    import os

    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _theta(hf_config: Any) -> float:
    from r3operator.trainer.megatron.config import rope_theta

    return rope_theta(hf_config)
