"""HF (transformers 5.x Qwen3-MoE, fused experts) <-> megatron-core GPTModel (local spec) weights.

Full (unsharded) Megatron names first; `shard_for_rank` / `gather_from_ranks` then cut or join the
tensor-parallel (`partition_dim` attribute), expert-parallel (global expert = ep_rank * local + i) and
pipeline (global layer = offset + local) dimensions.

Layouts that are not a plain rename:
- linear_qkv [ng * (nq/ng + 2) * hd, H]: per query group g, its q heads, then k_g, then v_g;
- (local_experts.e.)linear_fc1 [2I, H] = [gate; up] (GLU: act(first half) * second half), and TP shards
  gate and up separately, so rank r holds [gate_r; up_r];
- HF experts are fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_L = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ML = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def hf_to_megatron(sd: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    """Full HF state dict -> full Megatron state dict (global layer numbers, all experts)."""
    import torch

    nq, ng, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out: dict[str, Any] = {}
    for name, t in sd.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        m = _L.match(name)
        if m is None:
            raise KeyError(f"unexpected HF tensor {name!r}")
        layer, rest = int(m.group(1)), m.group(2)
        pre = f"decoder.layers.{layer}."
        if rest in _RENAMES:
            out[pre + _RENAMES[rest]] = t
        elif rest == "self_attn.q_proj.weight":
            h = t.shape[1]
            q = t.view(ng, nq // ng * hd, h)
            k = sd[f"model.layers.{layer}.self_attn.k_proj.weight"].view(ng, hd, h)
            v = sd[f"model.layers.{layer}.self_attn.v_proj.weight"].view(ng, hd, h)
            out[pre + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        elif rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight"):
            continue  # consumed with q_proj / gate_proj
        elif rest == "mlp.gate_proj.weight":
            up = sd[f"model.layers.{layer}.mlp.up_proj.weight"]
            out[pre + "mlp.linear_fc1.weight"] = torch.cat([t, up], dim=0)
        elif rest == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = t[e]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = t[e]
        else:
            raise KeyError(f"unexpected HF tensor {name!r}")
    return out


def megatron_to_hf(sd: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    """Inverse of `hf_to_megatron` (full dicts): transformers' in-memory names, experts fused."""
    import torch

    nq, ng, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_top = {v: k for k, v in _TOP.items()}
    inv = {v: k for k, v in _RENAMES.items()}
    out: dict[str, Any] = {}
    experts: dict[int, dict[str, dict[int, Any]]] = {}
    for name, t in sd.items():
        if name in inv_top:
            out[inv_top[name]] = t
            continue
        m = _ML.match(name)
        if m is None:
            raise KeyError(f"unexpected Megatron tensor {name!r}")
        layer, rest = int(m.group(1)), m.group(2)
        pre = f"model.layers.{layer}."
        if e := _EXPERT.match(rest):
            experts.setdefault(layer, {}).setdefault(e.group(2), {})[int(e.group(1))] = t
        elif rest in inv:
            out[pre + inv[rest]] = t
        elif rest == "self_attention.linear_qkv.weight":
            h = t.shape[1]
            qkv = t.view(ng, (nq // ng + 2) * hd, h)
            q, k, v = qkv.split([nq // ng * hd, hd, hd], dim=1)
            out[pre + "self_attn.q_proj.weight"] = q.reshape(-1, h).contiguous()
            out[pre + "self_attn.k_proj.weight"] = k.reshape(-1, h).contiguous()
            out[pre + "self_attn.v_proj.weight"] = v.reshape(-1, h).contiguous()
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[pre + "mlp.gate_proj.weight"] = gate.contiguous()
            out[pre + "mlp.up_proj.weight"] = up.contiguous()
        elif rest.endswith("_extra_state"):
            continue
        else:
            raise KeyError(f"unexpected Megatron tensor {name!r}")
    for layer, parts in experts.items():
        pre = f"model.layers.{layer}.mlp.experts."
        out[pre + "gate_up_proj"] = torch.stack([parts["linear_fc1"][e] for e in sorted(parts["linear_fc1"])])
        out[pre + "down_proj"] = torch.stack([parts["linear_fc2"][e] for e in sorted(parts["linear_fc2"])])
    return out


# --- sharding ------------------------------------------------------------------------------------------


def _is_glu_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def shard_tensor(name: str, full: Any, *, partition_dim: int | None, tp: int, rank: int) -> Any:
    """This TP rank's slice of a full tensor (GLU fc1: gate and up halves sharded separately)."""
    import torch

    if partition_dim is None or tp == 1:
        return full
    if _is_glu_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=partition_dim)[rank]


def join_shards(name: str, shards: list[Any], *, partition_dim: int | None) -> Any:
    """Inverse of `shard_tensor` over all TP ranks' shards (in rank order)."""
    import torch

    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if _is_glu_fc1(name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)


def local_to_global_name(name: str, *, layer_offset: int, expert_offset: int) -> str:
    """Local parameter name (this PP stage, this EP rank) -> full-model name."""
    m = _ML.match(name)
    if m is None:
        return name
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    if e := _EXPERT.match(rest):
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}.weight"
    return f"decoder.layers.{layer}.{rest}"
