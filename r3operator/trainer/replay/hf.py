"""Router replay (R3) and routing recording (R2 / diagnostics) for transformers 5.x MoE models.

transformers 5.x MoE blocks call a `*TopKRouter` gate (`.mlp.gate`) that returns
`(router_logits [N, E], router_scores [N, K], router_indices [N, K])` and feed scores + indices to the
fused experts. A forward hook that returns a replacement tuple therefore controls routing completely:

- the replayed ids are the engine's (vLLM's) ids for this token and *absolute* layer index;
- the gate values are recomputed from the live logits with the family's own score function (same
  dtype casts, same renormalisation, same scaling), gathered at the replayed ids, so gradients reach
  the gate weight exactly as they would if the router had chosen those ids itself.

Indices are stored per layer (not consumed FIFO) and stay armed until `disarm()`, so gradient-checkpoint
recompute in backward sees the same ids. Rows flagged in `padding_mask` (no captured route) fall back to
the router's natural choice, which keeps uncaptured prefix rows (multi-turn `routed_experts_prompt_start`)
exact instead of pushing dummy experts through hidden states that later tokens attend to.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from r3operator.trainer.replay.rows import first_unreplayable

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

# Any: transformers' MoE blocks and routers of every family are different classes with no common type: Any here.

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class UnsupportedRouterError(NotImplementedError):
    """The model's router family has no replay implementation on the HF backend."""


class RouterReplayError(ValueError):
    """Replay indices do not fit the model or the batch (shape, layer count, expert range)."""


# --- score functions: (module, live logits [N, E], ids [N, K] int64) -> gate values --------------------


def _softmax_scores(
    module: nn.Module, logits: torch.Tensor, idx: torch.Tensor, *, norm: bool | None, cast_back: bool
) -> torch.Tensor:
    import torch

    # Qwen2/3-MoE, OLMoE, Qwen3.5: softmax(logits, dtype=float); Mixtral: softmax(logits.float()) (same).
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.gather(-1, idx)
    if norm if norm is not None else bool(getattr(module, "norm_topk_prob", True)):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype) if cast_back else top


def _softmax_norm_attr(module: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _softmax_scores(module, logits, idx, norm=None, cast_back=True)


def _softmax_norm_always(module: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _softmax_scores(module, logits, idx, norm=True, cast_back=True)


def _softmax_norm_fp32(module: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _softmax_scores(module, logits, idx, norm=True, cast_back=False)


def _sigmoid_bias(module: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # DeepSeek-V3 / GLM-4-MoE: selection used sigmoid + e_score_correction_bias (+ group limits); the
    # replayed ids replace all of that. Gate values come from the *unbiased* sigmoid scores, computed as the
    # router does, in the logits' own dtype: the router casts its inputs to fp32, but under bf16 autocast its
    # linear still returns bf16, and a sigmoid taken in fp32 here would move every gate value off the
    # natural one.
    scores = logits.sigmoid()
    top = scores.gather(-1, idx)
    if module.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    # A float the router copied from its config (nn.Module types unknown attributes as Tensor | Module).
    return top * cast(float, module.routed_scaling_factor)


@dataclass(frozen=True)
class RouterFamily:
    name: str
    score_fn: Callable[[Any, Any, Any], Any]


# Each entry was checked against the installed transformers (5.23.0) router `forward`.
ROUTER_FAMILIES: dict[str, RouterFamily] = {
    "Qwen3MoeTopKRouter": RouterFamily("qwen3_moe", _softmax_norm_attr),
    "Qwen2MoeTopKRouter": RouterFamily("qwen2_moe", _softmax_norm_attr),
    "OlmoeTopKRouter": RouterFamily("olmoe", _softmax_norm_attr),
    "Qwen3NextTopKRouter": RouterFamily("qwen3_next", _softmax_norm_attr),
    "Qwen3_5MoeTopKRouter": RouterFamily("qwen3_5_moe", _softmax_norm_always),
    "Qwen3VLMoeTextTopKRouter": RouterFamily("qwen3_vl_moe", _softmax_norm_always),
    "MixtralTopKRouter": RouterFamily("mixtral", _softmax_norm_fp32),
    "DeepseekV3TopkRouter": RouterFamily("deepseek_v3", _sigmoid_bias),
    "Glm4MoeTopkRouter": RouterFamily("glm4_moe", _sigmoid_bias),
}


def _is_router(module: nn.Module) -> bool:
    return type(module).__name__.lower().endswith("topkrouter")


@dataclass(frozen=True)
class RouterSite:
    name: str
    layer: int
    module: Any  # nn.Module
    family: RouterFamily


def find_routers(model: nn.Module) -> list[RouterSite]:
    """All `*TopKRouter` modules with their absolute decoder-layer index, sorted by layer.

    Raises `UnsupportedRouterError` for a router class without a replay implementation.
    """
    sites = []
    for name, module in model.named_modules():
        if not _is_router(module):
            continue
        cls = type(module).__name__
        family = ROUTER_FAMILIES.get(cls)
        if family is None:
            raise UnsupportedRouterError(
                f"router {cls} at {name!r} has no HF replay implementation (supported: "
                f"{sorted(ROUTER_FAMILIES)}); use `trainer.backend: Megatron` for this model family"
            )
        match = _LAYER_RE.search(name)
        if match is None:
            raise UnsupportedRouterError(f"cannot parse a decoder layer index from router module name {name!r}")
        sites.append(RouterSite(name, int(match.group(1)), module, family))
    if not sites:
        raise UnsupportedRouterError(f"{type(model).__name__} has no *TopKRouter modules: not a supported MoE")
    return sorted(sites, key=lambda s: s.layer)


def flatten_for_router(
    indices: torch.Tensor,
    *,
    nnz_indices: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, S, L, K] (or already-flat [N, L, K]) -> [N, L, K] in the row order the routers see.

    `nnz_indices` are the flat positions kept by sample packing (`unpad_input`'s indices); they select
    rows of the row-major flattened batch, like the inputs. `padding_mask` ([B, S] or [N], True = no
    route) is flattened the same way.
    """
    if indices.dim() == 4:
        flat = indices.reshape(-1, indices.shape[2], indices.shape[3])
        mask = padding_mask.reshape(-1) if padding_mask is not None else None
    elif indices.dim() == 3:
        flat, mask = indices, (padding_mask.reshape(-1) if padding_mask is not None else None)
    else:
        raise RouterReplayError(f"replay indices must be [B, S, L, K] or [N, L, K], got shape {tuple(indices.shape)}")
    if mask is not None and mask.shape[0] != flat.shape[0]:
        raise RouterReplayError(f"padding_mask has {mask.shape[0]} rows, indices have {flat.shape[0]}")
    if nnz_indices is not None:
        flat = flat[nnz_indices]
        mask = mask[nnz_indices] if mask is not None else None
    return flat, mask


class RouterReplay:
    """Replays given expert ids in every `*TopKRouter` of one model.

    Usage::

        replay = RouterReplay()
        replay.install(model)
        with replay.armed(indices_bsLK, padding_mask=mask):   # or replay.arm(...) / replay.disarm()
            loss = loss_fn(model(input_ids, attention_mask=am)); loss.backward()

    For a reference model, install another `RouterReplay` on it and arm it with the same indices.
    """

    def __init__(self, *, gate_dtype: torch.dtype | None = None) -> None:
        """`gate_dtype=None` returns gate values in the dtype the family's router returns (exact match
        with the model). `torch.float32` keeps them fp32 so the experts weight and accumulate in fp32,
        like vLLM's fused MoE; a numerics choice for the fidelity benchmark, not a routing change."""
        self.gate_dtype = gate_dtype
        self._sites: list[RouterSite] = []
        self._handles: list[Any] = []
        self._per_layer: dict[int, torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self.num_layers = 0  # decoder layers of the installed model (dense ones included)
        self.active = False
        self.calls: dict[int, int] = {}
        """Per MoE layer, how many forwards its hook replayed since the last `arm()`: a count the step loop
        checks (routing/checks.py, hooks-not-fired), since a hook on a router the model no longer calls
        never runs."""

    # -- lifetime ---------------------------------------------------------------------------------------
    def install(self, model: nn.Module) -> RouterReplay:
        if self._handles:
            raise RuntimeError("RouterReplay is already installed; call remove() first")
        self._sites = find_routers(model)
        config_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        self.num_layers = int(config_layers) if config_layers is not None else max(self.layers) + 1
        for site in self._sites:
            self._handles.append(site.module.register_forward_hook(self._make_hook(site)))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.disarm()

    @property
    def layers(self) -> list[int]:
        return [site.layer for site in self._sites]

    def arm(
        self,
        indices: torch.Tensor | Sequence[torch.Tensor | None],
        *,
        nnz_indices: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> None:
        """Arm with [B, S, L, K] / [N, L, K] ids (absolute layer axis) or a per-layer list of [N, K].

        The ids are converted to int64 once here, not per hook call. A layer whose entry is None routes
        naturally; so do rows flagged True in `padding_mask` ("no route"). Raises `RouterReplayError` when
        the layer axis does not match the model, or a row that replays on an MoE layer is not K distinct
        in-range ids (an all-zero row included). Stays armed (through backward and checkpoint recompute)
        until `disarm()`.
        """
        import torch

        if not self._sites:
            raise RuntimeError("RouterReplay.arm() before install(model)")
        if isinstance(indices, torch.Tensor):
            flat, mask = flatten_for_router(indices, nnz_indices=nnz_indices, padding_mask=padding_mask)
            if flat.shape[1] != self.num_layers:
                raise RouterReplayError(
                    f"replay indices cover {flat.shape[1]} layers but the model has {self.num_layers} decoder "
                    "layers; routes must hold every decoder layer (dense ones as zero rows), as vLLM reports them"
                )
            per_layer: dict[int, torch.Tensor] = {s.layer: flat[:, s.layer] for s in self._sites}
        else:
            if len(indices) != self.num_layers:
                raise RouterReplayError(
                    f"{len(indices)} per-layer replay entries but the model has {self.num_layers} decoder layers"
                )
            if padding_mask is not None:
                mask = padding_mask.reshape(-1)
                mask = mask[nnz_indices] if nnz_indices is not None else mask
            else:
                mask = None
            per_layer = {layer: t for layer, t in enumerate(indices) if t is not None}
        checked: dict[int, torch.Tensor] = {}
        for site in self._sites:
            ids = per_layer.get(site.layer)
            if ids is None:
                continue
            top_k = site.module.top_k
            if ids.dim() != 2 or ids.shape[1] != top_k:
                raise RouterReplayError(f"layer {site.layer}: ids shape {tuple(ids.shape)} is not [N, top_k={top_k}]")
            if mask is not None and mask.shape[0] != ids.shape[0]:
                raise RouterReplayError(
                    f"layer {site.layer}: padding_mask has {mask.shape[0]} rows, replay ids {ids.shape[0]}"
                )
            checked[site.layer] = ids.to(torch.int64).contiguous()
        if checked:
            problem = first_unreplayable(checked, mask, num_experts=self._sites[0].module.num_experts)
            if problem is not None:
                raise RouterReplayError(problem)
        self._per_layer = checked
        self._mask = mask.to(torch.bool) if mask is not None else None
        self.calls = dict.fromkeys(self.layers, 0)
        self.active = True

    def disarm(self) -> None:
        self._per_layer = {}
        self._mask = None
        self.active = False

    def armed(self, indices: Any, **kwargs: Any) -> _Armed:
        return _Armed(self, indices, kwargs)

    def __enter__(self) -> RouterReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    # -- the hook ---------------------------------------------------------------------------------------
    def _make_hook(self, site: RouterSite) -> Callable[..., Any]:
        import torch

        def hook(module: nn.Module, _args: Any, output: Any) -> Any:
            if not self.active:
                return None
            ids = self._per_layer.get(site.layer)
            if ids is None:
                return None
            logits = output[0]
            if ids.shape[0] != logits.shape[0]:
                raise RouterReplayError(
                    f"layer {site.layer}: router sees {logits.shape[0]} tokens but {ids.shape[0]} replay "
                    "rows were armed (check padding / packing alignment)"
                )
            self.calls[site.layer] = self.calls.get(site.layer, 0) + 1
            ids = ids.to(logits.device, non_blocking=True)
            if self._mask is not None:
                ids = torch.where(self._mask.to(logits.device)[:, None], output[2].to(torch.int64), ids)
            scores = site.family.score_fn(module, logits, ids)
            if self.gate_dtype is not None:
                scores = scores.to(self.gate_dtype)
            return logits, scores, ids

        return hook


class _Armed:
    def __init__(self, replay: RouterReplay, indices: Any, kwargs: dict[str, Any]) -> None:
        self.replay, self.indices, self.kwargs = replay, indices, kwargs

    def __enter__(self) -> RouterReplay:
        self.replay.arm(self.indices, **self.kwargs)
        return self.replay

    def __exit__(self, *exc: object) -> None:
        self.replay.disarm()


class RouterRecorder:
    """Records the ids each router's MoE block uses, per absolute layer (last forward wins).

    `natural=True` registers the hook in front of any replay hook, so it records what the router
    *would* choose on this forward's hidden states (R2 record-then-replay, diagnostics); `natural=False`
    records what the experts actually receive (the replayed ids while a `RouterReplay` is armed).
    """

    def __init__(self, *, natural: bool = True) -> None:
        self.natural = natural
        self.records: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._sites: list[RouterSite] = []

    def install(self, model: nn.Module) -> RouterRecorder:
        self._sites = find_routers(model)
        for site in self._sites:
            self._handles.append(site.module.register_forward_hook(self._make_hook(site.layer), prepend=self.natural))
        return self

    def _make_hook(self, layer: int) -> Callable[..., Any]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self.records[layer] = output[2].detach().clone()

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        self.records = {}

    def stacked(self, num_layers: int | None = None) -> torch.Tensor:
        """[N, L, K] int64; layers without a router (dense) are zero, like vLLM reports them."""
        import torch

        if not self.records:
            raise RuntimeError("RouterRecorder has recorded nothing; run a forward first")
        first = next(iter(self.records.values()))
        layers = num_layers if num_layers is not None else max(self.records) + 1
        out = torch.zeros(first.shape[0], layers, first.shape[1], dtype=torch.int64, device=first.device)
        for layer, ids in self.records.items():
            out[:, layer] = ids
        return out

    def __enter__(self) -> RouterRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def natural_routing(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    replay: RouterReplay | None = None,
    **forward_kwargs: Any,
) -> torch.Tensor:
    """[B, S, L, K] ids the model chooses by itself (a no-grad forward with any `replay` disarmed).

    Used for the routing-agreement metric (trainer natural routing vs engine routing) and for R2.
    """
    import torch

    saved = None
    if replay is not None and replay.active:
        saved = (replay._per_layer, replay._mask)
        replay.active = False
    try:
        with RouterRecorder(natural=True).install(model) as rec, torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs)
            num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
            ids = rec.stacked(num_layers)
    finally:
        if saved is not None and replay is not None:
            replay._per_layer, replay._mask = saved
            replay.active = True
    b, s = input_ids.shape[:2]
    return ids.reshape(b, s, ids.shape[1], ids.shape[2])
