"""Router replay (R3) and record-then-replay (R2) through megatron-core's native `RouterReplay`.

megatron-core (checked against 0.19.2) gives every `TopKRouter` built with
`TransformerConfig.moe_enable_routing_replay=True` a `RouterReplay` instance, appended to the
*process-global* class list `RouterReplay.global_router_replay_instances` in construction order, and
(since 0.19.0) `set_layer_number` copies the router's 1-based GLOBAL layer number (pipeline offset
included) to `router_replay.layer_number`. `topk_routing_with_score_function` asks the instance for the
top-k: RECORD computes natively and keeps the ids; REPLAY_FORWARD gathers the scores at
`target_topk_idx`; REPLAY_BACKWARD pops `replay_backward_list` (every `set_target_indices` appends to it),
so activation recompute in backward replays in forward order. `moe_router_fusion=True` returns from the
fused kernel before any of this: replay would be silently ignored, so it is refused here.

Megatron does none of the data alignment. Per micro-batch this module:

1. maps the rollout's [B, S, L, K] routes (L = every decoder layer, dense ones included, as vLLM reports
   them) to this pipeline stage's routers by global `layer_number - 1`;
2. marks rows without a captured route with `UNCAPTURED` ids; `ReplaySession` gives every RouterReplay
   instance a top-k that routes those rows naturally (what the HF hook does), so an uncaptured prefix
   moves later tokens exactly as it would without replay. The same rows go to GPTModel as the MoE
   `padding_mask` (True = pad), so aux-loss / expert-bias accounting skips them;
3. slices the rows exactly like the hidden states: optional THD packing (`pack_rows`, the inputs'
   non-pad tokens in row-major order), context parallel (2·cp zig-zag chunks, `cp_zigzag`, the same
   split as `megatron.core.utils.get_batch_on_this_cp_rank`), sequence parallel (this TP rank's
   contiguous chunk of the sequence, like `scatter_to_sequence_parallel_region`);
4. flattens sequence-major (`[S, B]`: Megatron's hidden states are [S, B, H] and the router views its
   logits as [S*B, E]) into one int64 [tokens, K] tensor per local router, in instance order.

Pure functions (`plan_micro_batch` and friends) take torch tensors only, so CPU tests cover them; the
`ReplaySession` drives the real `RouterReplay` state machine.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from r3operator.trainer.replay.rows import first_unreplayable

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Any: Megatron-Core ships no type information: its routers and layers are Any here.

UNCAPTURED = -1  # replay id of a row without a captured route: that row routes naturally
ROUTER_FUSION_FIELD = "trainer.megatron.routerFusion"
# What the routers do in one forward (not the job's replay mode, api.enums.ReplayMode, which picks them
# per pass): route naturally, replay the engine's routes, record their own (R2's old-logprob pass), or
# replay what they recorded (R2's update).
RouterAction = Literal["off", "R3", "R2-record", "R2-replay"]


class MegatronReplayError(ValueError):
    """Replay data or configuration that cannot be applied to this Megatron model."""


# --- configuration -------------------------------------------------------------------------------------


def check_replay_config(config: Any) -> None:
    """Raise unless a TransformerConfig can replay: routing replay on, router fusion off."""
    if getattr(config, "moe_router_fusion", False):
        raise MegatronReplayError(
            f"{ROUTER_FUSION_FIELD}=true (moe_router_fusion) cannot be used with routing replay: the fused "
            "top-k kernel returns before RouterReplay is consulted, so replayed routes would be silently "
            f"ignored; set {ROUTER_FUSION_FIELD}: false"
        )
    if not getattr(config, "moe_enable_routing_replay", False):
        raise MegatronReplayError("TransformerConfig.moe_enable_routing_replay must be True to replay routes")


def replay_instances() -> list[Any]:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return list(RouterReplay.global_router_replay_instances)


def clear_all_replay_state(*, instances: bool = False) -> None:
    """Clear indices + actions of every global instance (and the instance list itself if asked)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    if instances:
        RouterReplay.clear_global_router_replay_instances()


def adopt_layer_numbers(model: Any) -> int:
    """Give each router's RouterReplay its router's global layer number; returns how many were set.

    megatron-core >= 0.19 propagates `TopKRouter.set_layer_number` to `router_replay.layer_number` itself.
    0.16-0.18 (the releases that run on Python 3.11) set it on the router only, so we copy it across after
    the model is built instead of monkey-patching `set_layer_number` (SkyRL's approach).
    """
    adopted = 0
    for module in model.modules():
        replay = getattr(module, "router_replay", None)
        number = getattr(module, "layer_number", None)
        if replay is not None and number is not None and getattr(replay, "layer_number", None) is None:
            replay.layer_number = number
            adopted += 1
    return adopted


def instance_layers(instances: Sequence[Any]) -> list[int]:
    """0-based global decoder-layer index of each RouterReplay instance, in instance order."""
    layers = []
    for i, inst in enumerate(instances):
        number = getattr(inst, "layer_number", None)
        if number is None:
            raise MegatronReplayError(
                f"RouterReplay instance {i} has no layer_number (megatron-core < 0.19 or a router built outside "
                "a TransformerLayer); cannot map routes by global layer"
            )
        layers.append(int(number) - 1)
    if len(set(layers)) != len(layers):
        raise MegatronReplayError(
            f"RouterReplay instances share layer numbers {layers}: stale instances from another model "
            "(call RouterReplay.clear_global_router_replay_instances() before building each model) or MTP routers"
        )
    return layers


# --- pure slicing helpers ------------------------------------------------------------------------------


def cp_zigzag(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's chunks (cp_rank, 2·cp−1−cp_rank) of 2·cp equal sequence chunks, concatenated.

    Same split as `get_batch_on_this_cp_rank` (per-sequence balancing) applies to tokens/labels.
    """
    if cp_size == 1:
        return x
    seq = x.shape[seq_dim]
    if seq % (2 * cp_size):
        raise MegatronReplayError(f"sequence length {seq} is not divisible by 2*contextParallelSize={2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return _cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], seq_dim)


def sp_shard(x: torch.Tensor, tp_size: int, tp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This TP rank's contiguous sequence chunk (sequence parallel scatters hidden states this way)."""
    if tp_size == 1:
        return x
    seq = x.shape[seq_dim]
    if seq % tp_size:
        raise MegatronReplayError(f"sequence length {seq} is not divisible by tensorParallelSize={tp_size}")
    return x.narrow(seq_dim, tp_rank * (seq // tp_size), seq // tp_size)


def pack_rows(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> [1, T, ...]: the non-pad tokens in row-major order (THD packing of the inputs)."""
    if x.shape[:2] != attention_mask.shape:
        shape = tuple(attention_mask.shape)
        raise MegatronReplayError(f"rows {tuple(x.shape[:2])} do not match attention_mask {shape}")
    return x[attention_mask.bool()].unsqueeze(0)


def to_router_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, S, K] -> [S*B, K]: the order in which the router sees tokens ([S, B, H] hidden states)."""
    return x.transpose(0, 1).reshape(-1, x.shape[-1])


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    import torch

    return torch.cat(parts, dim=dim)


@dataclass
class ParallelLayout:
    """Where this rank sits and how its hidden states were sliced."""

    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    first_pp_stage: bool = True
    packed: bool = False  # THD: inputs were packed with `pack_rows` before CP slicing

    def slice_rows(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Inputs-identical slicing for [B, S, ...]: pack -> CP zig-zag (dim 1)."""
        if self.packed:
            if attention_mask is None:
                raise MegatronReplayError("packed layout needs the attention_mask used to pack the inputs")
            x = pack_rows(x, attention_mask)
        return cp_zigzag(x, self.cp_size, self.cp_rank, seq_dim=1)

    def router_slice(self, x: torch.Tensor) -> torch.Tensor:
        """After slice_rows: the SP chunk the router of this TP rank sees."""
        return sp_shard(x, self.tp_size, self.tp_rank, seq_dim=1) if self.sequence_parallel else x


@dataclass
class ReplayPlan:
    per_layer: list[torch.Tensor]  # one int64 [local_tokens, K] per local router, instance order
    layers: list[int]  # global 0-based layer of each entry
    padding_mask: torch.Tensor | None  # [B, S_local] True = no route, as GPTModel.forward expects it


def plan_micro_batch(
    indices: torch.Tensor,
    padding_mask: torch.Tensor | None,
    layers: Sequence[int],
    layout: ParallelLayout,
    *,
    attention_mask: torch.Tensor | None = None,
    num_experts: int | None = None,
    num_layers: int | None = None,
) -> ReplayPlan:
    """Per-router index tensors for one micro-batch.

    `indices` [B, S, L, K] holds every decoder layer (dense ones ignored; `num_layers`, when given, must
    equal L); `layers` are the global 0-based layers of this stage's routers in instance order
    (`instance_layers`). Rows flagged in `padding_mask` [B, S] become `UNCAPTURED` (natural routing);
    every other row of a router's layer must be K distinct ids in `[0, num_experts)`.
    """
    import torch

    if indices.dim() != 4:
        raise MegatronReplayError(f"routes must be [B, S, L, K], got shape {tuple(indices.shape)}")
    if padding_mask is not None and padding_mask.shape != indices.shape[:2]:
        raise MegatronReplayError(
            f"padding_mask {tuple(padding_mask.shape)} does not match routes {tuple(indices.shape[:2])}"
        )
    have = indices.shape[2]
    if num_layers is not None and have != num_layers:
        raise MegatronReplayError(
            f"routes cover {have} layers but the model has {num_layers} decoder layers; routes must hold every "
            "decoder layer (dense ones as zero rows), as vLLM reports them"
        )
    if layers and max(layers) >= have:
        raise MegatronReplayError(
            f"routes cover {have} layers but a router sits in global layer {max(layers)}; "
            "vLLM must report every decoder layer"
        )
    sel = indices.index_select(2, torch.as_tensor(list(layers), dtype=torch.int64, device=indices.device))
    sel = sel.to(torch.int64)
    no_route = None if padding_mask is None else padding_mask.bool().to(sel.device)
    if num_experts is not None:
        per_layer_rows = {layer: sel[:, :, i].reshape(-1, sel.shape[-1]) for i, layer in enumerate(layers)}
        flat_no_route = None if no_route is None else no_route.reshape(-1)
        problem = first_unreplayable(per_layer_rows, flat_no_route, num_experts=num_experts)
        if problem is not None:
            raise MegatronReplayError(f"{problem} (rows are batch-major [B*S])")
    if no_route is not None:
        sel = sel.masked_fill(no_route[:, :, None, None], UNCAPTURED)
    sel = layout.router_slice(layout.slice_rows(sel, attention_mask))  # [B', S_local, L_local, K]
    per_layer = [to_router_rows(sel[:, :, i]).contiguous() for i in range(sel.shape[2])]
    mask = None
    if padding_mask is not None:
        mask = layout.slice_rows(padding_mask.bool(), attention_mask)
        # GPTModel SP-scatters the mask itself only on the first pipeline stage (it is scattered with the
        # embeddings there); later stages receive it as given.
        if layout.sequence_parallel and not layout.first_pp_stage:
            mask = layout.router_slice(mask)
    return ReplayPlan(per_layer, list(layers), mask)


def _replay_topk_with_natural_rows(
    replay: Any,
    scores: torch.Tensor,
    topk: int,
    num_groups: int | None = None,
    group_topk: int | None = None,
    default_compute_topk: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RouterReplay.get_replay_topk` with one change: rows whose replay ids are `UNCAPTURED` take the
    router's own top-k (computed on the live scores, exactly as without replay)."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    action = replay.router_replay_action
    if action is RouterReplayAction.REPLAY_FORWARD:
        target = replay.target_topk_idx
        replay.r3_forward_calls = getattr(replay, "r3_forward_calls", 0) + 1  # ReplaySession.hook_calls
    elif action is RouterReplayAction.REPLAY_BACKWARD:
        target = replay.replay_backward_list.pop(0)
    else:
        return RouterReplay.get_replay_topk(replay, scores, topk, num_groups, group_topk, default_compute_topk)
    target = target.to(scores.device)
    # The natural top-k for every row costs one topk per layer, the price of routing without replay; it
    # avoids a host sync on "does this micro-batch have uncaptured rows".
    natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
    ids = torch.where(target < 0, natural, target)
    return scores.gather(1, ids), ids


def route_uncaptured_rows_naturally(instances: Sequence[Any]) -> None:
    """Give each RouterReplay instance the top-k of `_replay_topk_with_natural_rows` (idempotent)."""
    for inst in instances:
        current = getattr(inst, "get_replay_topk", None)
        if getattr(current, "func", None) is _replay_topk_with_natural_rows:
            continue
        inst.get_replay_topk = functools.partial(_replay_topk_with_natural_rows, inst)


# --- the RouterReplay state machine ----------------------------------------------------------------------


@contextlib.contextmanager
def replay_schedule() -> Iterator[None]:
    """Wrap ONE forward-backward schedule: all global replay state is cleared before and after.

    The REPLAY_BACKWARD FIFO spans the micro-batches of a schedule, so clear only at its boundaries.
    """
    clear_all_replay_state()
    try:
        yield
    finally:
        clear_all_replay_state()


class ReplaySession:
    """Arms this process's RouterReplay instances per micro-batch.

    `forward_step` of a schedule calls `before_forward(...)` with the micro-batch's routes, then the model,
    then `after_forward()`; `recorded()` returns what RECORD captured (R2's old-logprob pass).
    """

    def __init__(
        self, layout: ParallelLayout, *, num_experts: int | None = None, num_layers: int | None = None
    ) -> None:
        self.layout = layout
        self.num_experts = num_experts
        self.num_layers = num_layers
        self.instances = replay_instances()
        self.layers = instance_layers(self.instances)
        route_uncaptured_rows_naturally(self.instances)

    def reset_hook_calls(self) -> None:
        for inst in self.instances:
            inst.r3_forward_calls = 0

    def hook_calls(self) -> dict[int, int]:
        """Per global layer of this rank's routers, the forwards that replayed since `reset_hook_calls()`: a
        count the step loop checks (routing/checks.py, hooks-not-fired)."""
        return {
            layer: int(getattr(inst, "r3_forward_calls", 0))
            for layer, inst in zip(self.layers, self.instances, strict=True)
        }

    def _check_instances(self) -> None:
        current = replay_instances()
        same = len(current) == len(self.instances) and all(a is b for a, b in zip(current, self.instances, strict=True))
        if not same:
            raise MegatronReplayError(
                f"the global RouterReplay list changed ({len(self.instances)} -> {len(current)} instances): another "
                "model was built in this process after this one"
            )

    def before_forward(
        self,
        mode: RouterAction,
        indices: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Set data + action for one micro-batch; returns the `padding_mask` to pass to GPTModel.forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self._check_instances()
        if mode == "off":
            RouterReplay.clear_global_router_replay_action()
            return None
        if mode == "R2-record":
            RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
            return None
        if indices is None:
            raise MegatronReplayError(f"replay mode {mode} needs routes for the micro-batch")
        plan = plan_micro_batch(
            indices,
            padding_mask,
            self.layers,
            self.layout,
            attention_mask=attention_mask,
            num_experts=self.num_experts,
            num_layers=self.num_layers,
        )
        if len(plan.per_layer) != len(self.instances):  # set_replay_data checks too; say why here
            raise MegatronReplayError(f"{len(plan.per_layer)} replay tensors for {len(self.instances)} routers")
        RouterReplay.set_replay_data(plan.per_layer)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return plan.padding_mask

    def after_forward(self, mode: RouterAction) -> None:
        """Recompute in backward must pop the FIFO in forward order: switch to REPLAY_BACKWARD."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        if mode in ("R3", "R2-replay"):
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def recorded(self, batch: int, seq: int) -> torch.Tensor:
        """RECORD results as [B, S_local, L_local, K] (local = this rank's slice, this stage's layers).

        The recorded rows are in router order ([S, B] flattened); this undoes that flattening.
        """
        import torch
        from megatron.core.transformer.moe.router_replay import RouterReplay

        data = RouterReplay.get_recorded_data()
        if any(t is None for t in data):
            raise MegatronReplayError("RouterReplay recorded nothing: run a forward in R2-record mode first")
        k = data[0].shape[-1]
        per_layer = [t.reshape(seq, batch, k).transpose(0, 1) for t in data]
        return torch.stack(per_layer, dim=2).to(torch.int64)
