"""Transformer Engine's attention as verl's Megatron engine calls it, on one GPU, in seconds, before verl starts.

verl 0.9.1 reaches its first Megatron forward (`compute_log_prob`) only after Ray, the model and the vLLM replicas
are up and the first rollouts are done (~5 min on the GPU machine). If TE then finds no attention backend for the
inputs, the run dies there. This probe builds the same `DotProductAttention` with the same inputs and runs one
forward (eval, as `compute_log_prob`) and one forward + backward (train, as `update_actor`):

- the NVTE_* switches megatron-core sets for verl's `override_transformer_config.attention_backend`, taken from
  megatron-core's own `LanguageModule._set_attention_backend` (what every Megatron model runs when it is built);
- heads, KV heads and head dim from the model directory verl loads (`config.json`);
- what `TEDotProductAttention` passes TE for verl's packed batches (`use_remove_padding=True`,
  `verl/models/mcore/util.py: preprocess_packed_seqs`): `qkv_format="thd"`, `attn_mask_type="padding_causal"`
  (Megatron turns `causal` into it for thd), `cu_seqlens_{q,kv}` equal to their `_padded` twins (TP 1, CP 1: no
  padding between sequences), bf16, one micro-batch of `group_size` sequences up to prompt + response tokens.

It prints the backend TE chose and checks the output against PyTorch's attention per sequence; when TE has no
backend it prints TE's own reasons (its NVTE_DEBUG log: "Disabling FusedAttention due to NVTE_FUSED_ATTN=0", …).
The last line is `TE_PREFLIGHT {json}`; the exit status is 0 only when both passes ran on a backend and matched.

    python3 -m benchmarks.peers.te_preflight --model DIR/inputs/model --attention-backend fused
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MARKER = "TE_PREFLIGHT "
SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
# bf16 attention against an fp32 reference: rounding stays near 1e-2; a wrong mask or head grouping is off by ~1.
TOLERANCE = 0.1


class PreflightError(ValueError):
    """Input the probe cannot run with; the message names the file and the field."""


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config_path: Path) -> AttentionShape:
    """Heads, KV heads and head dim as mbridge reads them from the HF config (head_dim, else hidden / heads)."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PreflightError(f"{config_path}: cannot read the model's config ({exc})") from None

    def positive(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PreflightError(f"{config_path}: field {name!r} must be a positive integer, got {value!r}")
        return value

    heads = positive("num_attention_heads", config.get("num_attention_heads"))
    kv_heads = positive("num_key_value_heads", config.get("num_key_value_heads", heads))
    if heads % kv_heads:
        raise PreflightError(
            f"{config_path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = positive("hidden_size", config.get("hidden_size"))
        head_dim = hidden // heads
    return AttentionShape(heads=heads, kv_heads=kv_heads, head_dim=positive("head_dim", head_dim))


def packed_lengths(sequences: int, max_tokens: int) -> list[int]:
    """One micro-batch of prompt + response lengths, spread from `max_tokens` down (no two alike, none empty)."""
    if sequences < 1 or max_tokens < 1:
        raise PreflightError(f"sequences ({sequences}) and max_tokens ({max_tokens}) must be at least 1")
    return [max(1, max_tokens - (i * max_tokens) // sequences) for i in range(sequences)]


def megatron_attention_env(backend: str) -> dict[str, str]:
    """The NVTE_* switches megatron-core sets for `attention_backend=backend`, from megatron-core itself.

    Every Megatron language model calls `_set_attention_backend` when it is built; verl's mbridge path builds the
    TransformerConfig from `override_transformer_config`. The process's environment is left as it was."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    if backend not in AttnBackend.__members__:
        raise PreflightError(
            f"--attention-backend: expected one of {', '.join(AttnBackend.__members__)}, got {backend!r}"
        )
    saved = {name: os.environ.pop(name, None) for name in SWITCHES}
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=4, attention_backend=AttnBackend[backend]
        )
        LanguageModule._set_attention_backend(SimpleNamespace(config=config))
        return {name: os.environ[name] for name in SWITCHES if name in os.environ}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def chosen_backend(backends: Mapping[str, Any]) -> str | None:
    """TE's choice as its `_attention_backends` cache holds it after a forward, in TE's own words."""
    if backends.get("use_flash_attention"):
        return f"FlashAttention ({backends.get('flash_attention_backend')})"
    if backends.get("use_fused_attention"):
        sub = backends.get("fused_attention_backend")
        return f"FusedAttention (sub-backend {int(sub) if sub is not None else '?'})"
    if backends.get("use_unfused_attention"):
        return "UnfusedDotProductAttention"
    return None


def te_reasons(lines: list[str]) -> list[str]:
    """TE's debug lines that give its run config (cuDNN version, compute capability, …), why a backend was left
    out, and what was left; in TE's order, once each."""
    keep = ("Running with", "Disabling", "Available backends", "Selected backend", "flash-attn")
    seen: dict[str, None] = {}
    for line in lines:
        if any(word in line for word in keep):
            seen.setdefault(line.strip(), None)
    return list(seen)


@dataclass
class Verdict:
    ok: bool
    attention_backend: str
    switches: dict[str, str] = field(default_factory=dict)
    passes: dict[str, str | None] = field(default_factory=dict)  # pass name -> TE's backend (None: none)
    max_abs_error: float | None = None
    reason: str = ""
    te_log: list[str] = field(default_factory=list)

    def line(self) -> str:
        return MARKER + json.dumps(asdict(self), sort_keys=True)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        print(f"[TE {record.levelname}] {record.getMessage()}", file=sys.stderr, flush=True)


@contextmanager
def te_debug_log() -> Iterator[_Collect]:
    """TE's attention loggers at DEBUG (it reads NVTE_DEBUG / NVTE_DEBUG_LEVEL when it is imported)."""
    os.environ["NVTE_DEBUG"] = "1"
    os.environ["NVTE_DEBUG_LEVEL"] = "2"
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in ("transformer_engine", "DotProductAttention")]
    for logger in loggers:
        logger.addHandler(collect)
    try:
        yield collect
    finally:
        for logger in loggers:
            logger.removeHandler(collect)


def probe(shape: AttentionShape, lengths: list[int], backend: str, device: str = "cuda") -> Verdict:
    """One eval forward and one train forward + backward on `device` (the first GPU); the verdict says which backend
    TE chose."""
    switches = megatron_attention_env(backend)
    os.environ.update(switches)
    verdict = Verdict(ok=False, attention_backend=backend, switches=switches)
    with te_debug_log() as log:
        try:
            _run_passes(shape, lengths, verdict, device)
        except Exception as exc:  # TE's own error is the message the runner shows
            verdict.reason = f"{type(exc).__name__}: {exc}"
        verdict.te_log = te_reasons(log.lines)
    if not verdict.reason and any(chosen is None for chosen in verdict.passes.values()):
        verdict.reason = "Transformer Engine chose no attention backend"
    verdict.ok = not verdict.reason
    return verdict


def _run_passes(shape: AttentionShape, lengths: list[int], verdict: Verdict, device_name: str) -> None:
    import torch

    # Only in verl's packages on the GPU machine (verl-setup.sh), never in the CPU venv mypy checks.
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]
    from transformer_engine.pytorch.attention.dot_product_attention import (  # type: ignore[import-not-found]
        dot_product_attention as te_dpa,
    )

    if device_name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the probe runs on the GPU verl will use")
    device = torch.device(device_name)
    torch.manual_seed(0)
    # As megatron-core's TEDotProductAttention builds it for a self-attention layer of verl's model.
    attention = te.DotProductAttention(
        num_attention_heads=shape.heads,
        kv_channels=shape.head_dim,
        num_gqa_groups=shape.kv_heads,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal",
        layer_number=1,
        attention_type="self",
    ).to(device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=device), dim=0)
    tokens = sum(lengths)

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, shape.head_dim, device=device, dtype=torch.bfloat16)

    q, k, v = tensor(shape.heads), tensor(shape.kv_heads), tensor(shape.kv_heads)
    packed = {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cu,
        "cu_seqlens_kv_padded": cu,
        "max_seqlen_q": max(lengths),
        "max_seqlen_kv": max(lengths),
    }
    for name, training in (("compute_log_prob (eval forward)", False), ("update_actor (train forward+backward)", True)):
        attention.train(training)
        inputs = [t.detach().clone().requires_grad_(training) for t in (q, k, v)]
        with torch.set_grad_enabled(training):
            out = attention(*inputs, None, **packed)
            cache = getattr(te_dpa, "_attention_backends", None)  # TE's module-level record of its choice
            verdict.passes[name] = chosen_backend(cache) if cache is not None else "a backend (TE's record unread)"
            if training:
                out.float().square().mean().backward()
                if not all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in inputs):
                    raise RuntimeError(f"{name}: gradients missing or not finite")
        if device.type == "cuda":
            torch.cuda.synchronize()
        error = _max_abs_error(out.detach(), q, k, v, lengths, shape)
        verdict.max_abs_error = max(error, verdict.max_abs_error or 0.0)
        if not error <= TOLERANCE:
            raise RuntimeError(f"{name}: output differs from PyTorch's attention by {error:.3g} (> {TOLERANCE})")


def _max_abs_error(out: Any, q: Any, k: Any, v: Any, lengths: list[int], shape: AttentionShape) -> float:
    """Causal attention per sequence in fp32 with PyTorch, query head h reading KV head h // (heads / kv_heads)."""
    import torch.nn.functional as F

    group = shape.heads // shape.kv_heads
    out = out.reshape(out.shape[0], shape.heads, shape.head_dim).float()
    worst, start = 0.0, 0
    for length in lengths:
        rows = slice(start, start + length)
        qs = q[rows].float().transpose(0, 1)  # [heads, t, d]
        ks = k[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1 / math.sqrt(shape.head_dim))
        worst = max(worst, float((out[rows].transpose(0, 1) - ref).abs().max()))
        start += length
    return worst


def main(argv: list[str] | None = None) -> int:
    from benchmarks.peers.verl_config import ATTENTION_BACKEND, Workload

    work = Workload()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the model directory verl loads (config.json)")
    parser.add_argument("--attention-backend", default=ATTENTION_BACKEND, help="verl's Megatron attention_backend")
    parser.add_argument("--sequences", type=int, default=work.group_size, help="sequences in one micro-batch")
    parser.add_argument(
        "--max-tokens", type=int, default=work.max_prompt_tokens + work.max_response_tokens, help="longest sequence"
    )
    args = parser.parse_args(argv)
    try:
        shape = attention_shape(args.model / "config.json")
        lengths = packed_lengths(args.sequences, args.max_tokens)
        verdict = probe(shape, lengths, args.attention_backend)
    except PreflightError as exc:
        verdict = Verdict(ok=False, attention_backend=args.attention_backend, reason=str(exc))
    except ImportError as exc:  # megatron-core or TE missing from verl's packages: verl could not run either
        verdict = Verdict(ok=False, attention_backend=args.attention_backend, reason=f"{type(exc).__name__}: {exc}")
    else:
        print(f"shape {asdict(shape)}, {len(lengths)} sequences, {sum(lengths)} tokens", flush=True)
    for name, backend in verdict.passes.items():
        print(f"{name}: {backend or 'no backend'}", flush=True)
    print(verdict.line(), flush=True)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
