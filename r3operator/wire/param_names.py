"""Which checkpoint (HF) tensors vLLM loads into each of its fused parameters, by name: the kernel layout's plan
(wire/kernel_layout.py) and the engine's receipt (wire/receipt.py: which fused blocks a checkpoint-layout sync had to
change) both ask it. Names only: no tensor, no vLLM.

- `…self_attn.qkv_proj.{weight,bias}` ← q_proj, k_proj, v_proj;
- `…gate_up_proj.weight` (a dense MLP or a shared expert) ← gate_proj, up_proj;
- `…mlp.experts[.<runner>].w13_weight` [E, 2I, H] ← the fused HF `mlp.experts.gate_up_proj`, or each expert's
  gate_proj and up_proj;
- `…mlp.experts[.<runner>].w2_weight` [E, H, I] ← the fused HF `mlp.experts.down_proj`, or each expert's down_proj;
- every other parameter ← the tensor of its own name.
"""

from __future__ import annotations

import re
from collections.abc import Container

_QKV = re.compile(r"^(?P<prefix>.*)\.qkv_proj\.(?P<leaf>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<prefix>.*)\.gate_up_proj\.weight$")
_W13 = re.compile(r"^(?P<experts>.*\.mlp\.experts)(?:\.[A-Za-z_]+)?\.w13_weight$")
_W2 = re.compile(r"^(?P<experts>.*\.mlp\.experts)(?:\.[A-Za-z_]+)?\.w2_weight$")

GATE_UP: tuple[str, str] = ("gate_proj", "up_proj")
"""vLLM's row order inside `gate_up_proj` and `w13_weight` (its `stacked_params_mapping` shard ids 0, 1)."""


def checkpoint_parts(
    name: str, shape: tuple[int, ...], trainer: Container[str], order: tuple[str, str] = GATE_UP
) -> tuple[str, tuple[str, ...], int]:
    """(kind, checkpoint tensor names in the parameter's row order, expert count) of engine parameter `name` of
    `shape`, given the names the trainer holds (only membership is asked). kind: "same" (one tensor as it is),
    "rows" (a cat along rows), "fused_w13" / "fused_w2" (the fused HF expert tensor), "experts_rows" (per expert, a cat
    of its tensors along rows, stacked). `order`: the halves of gate_up_proj and w13_weight."""
    if name in trainer:
        return "same", (name,), 0
    if match := _QKV.match(name):
        return "rows", tuple(f"{match['prefix']}.{p}.{match['leaf']}" for p in ("q_proj", "k_proj", "v_proj")), 0
    if match := _GATE_UP.match(name):
        return "rows", tuple(f"{match['prefix']}.{p}.weight" for p in order), 0
    for pattern, fused, per_expert in ((_W13, "gate_up_proj", order), (_W2, "down_proj", ("down_proj",))):
        if match := pattern.match(name):
            experts = match["experts"]
            if f"{experts}.{fused}" in trainer:
                return ("fused_w13" if fused == "gate_up_proj" else "fused_w2"), (f"{experts}.{fused}",), 0
            count = shape[0] if shape else 0
            return "experts_rows", tuple(f"{experts}.{e}.{p}.weight" for e in range(count) for p in per_expert), count
    return "same", (name,), 0


def checkpoint_feeds(name: str, shape: tuple[int, ...], received: Container[str]) -> tuple[str, ...]:
    """The checkpoint tensors among `received` (names) that vLLM loads into engine parameter `name` of `shape`: a
    fused parameter's q/k/v, gate/up or per-expert tensors, or the tensor of its own name."""
    _, parts, _ = checkpoint_parts(name, shape, received)
    return tuple(part for part in parts if part in received)
