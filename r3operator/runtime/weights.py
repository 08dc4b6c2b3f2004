"""Trainer state dict → checkpoint-format (HF on-disk names) chunks for the engines.

transformers 5.x keeps Qwen3-MoE / Qwen2-MoE / OLMoE experts fused (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]); checkpoints and vLLM's `load_weights` use per-expert
`mlp.experts.<e>.{gate,up,down}_proj.weight`. The split below is the inverse of transformers'
load-time fusion (gate rows first, then up rows), checked in tests against the file on disk.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.down_proj$")


def checkpoint_tensors(state_dict: Mapping[str, Any], *, dtype: Any = None) -> Iterator[tuple[str, Any]]:
    """Yield (checkpoint name, tensor) for every trainer tensor, experts unfused, detached, on CPU."""
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if hasattr(t, "full_tensor"):  # FSDP2 DTensor: gather the full parameter
            t = t.full_tensor()
        t = t.to("cpu")
        if dtype is not None:
            t = t.to(dtype)
        if match := _FUSED_GATE_UP.match(name):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{match['prefix']}.{e}.gate_proj.weight", t[e, :half].contiguous()
                yield f"{match['prefix']}.{e}.up_proj.weight", t[e, half:].contiguous()
        elif match := _FUSED_DOWN.match(name):
            for e in range(t.shape[0]):
                yield f"{match['prefix']}.{e}.down_proj.weight", t[e].contiguous()
        else:
            yield name, t.contiguous()


def chunk_tensors(
    tensors: Iterator[tuple[str, Any]], *, chunk_size_mb: int
) -> Iterator[list[tuple[str, Any]]]:
    """Group tensors into chunks of at most `chunk_size_mb` MiB (a larger single tensor is its own chunk)."""
    if chunk_size_mb < 1:
        raise ValueError(f"weightSync.chunkSizeMB must be >= 1, got {chunk_size_mb}")
    limit = chunk_size_mb * 1024 * 1024
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk
