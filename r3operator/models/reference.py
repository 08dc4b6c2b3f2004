"""Deterministic reference MoE checkpoints (transformers Qwen3-MoE architecture), generated locally.

Weights come from NumPy's PCG64 stream seeded per tensor by (spec seed, CRC32 of the tensor name), so
they do not depend on module construction order, the torch version or the machine: the same spec
gives bitwise-identical `model.safetensors` everywhere. Weights are rounded to bfloat16 and stored in
bfloat16, so a bf16 engine and an fp32 trainer see exactly the same parameter values.

The router is initialised wider than the other projections (`router_std`) so that top-k choices are
not near-ties everywhere: the natural engine-vs-trainer routing mismatch is then a few percent, as in
real models, instead of being dominated by rounding noise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from r3operator.models.tokenizer import BOS, EOS, PAD, save_tokenizer, vocabulary
from r3operator.settings import runtime_settings

if TYPE_CHECKING:  # optional dependencies, imported lazily at run time
    import torch
    from transformers import Qwen3MoeConfig

# Bump when the generation procedure changes: it is part of the cache key.
GENERATOR_VERSION = "1"


class ReferenceModelSpec(BaseModel):
    """Sizes and init scales of one reference model. Everything here enters the content hash."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    seed: int = 0
    vocab_size: int = Field(512, ge=128)
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512  # dense MLP size (unused when every layer is MoE; kept for config)
    moe_intermediate_size: int = 128
    num_experts: int = 32
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = True
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    init_std: float = 0.02
    router_std: float = 0.06
    lm_head_std: float = 0.05

    def content_hash(self) -> str:
        payload = json.dumps({"v": GENERATOR_VERSION, **self.model_dump()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def hf_config(self) -> Qwen3MoeConfig:
        from transformers import Qwen3MoeConfig

        vocab = vocabulary(self.vocab_size)
        return Qwen3MoeConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            # Not a declared field of the config class; the attention layers read it (else hidden/heads).
            head_dim=self.head_dim,  # type: ignore[call-arg]
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False,
            initializer_range=self.init_std,
            bos_token_id=vocab.index(BOS),
            eos_token_id=vocab.index(EOS),
            pad_token_id=vocab.index(PAD),
            dtype="bfloat16",
        )


REFERENCE_SPECS: dict[str, ReferenceModelSpec] = {
    # CPU tests and CI: ~10 M params, 2 cores.
    "tiny": ReferenceModelSpec(name="tiny"),
    # CPU benchmarks: the GPU reference's routing shape (8 layers, 64 experts, top-8) at CPU size.
    "small": ReferenceModelSpec(
        name="small", num_hidden_layers=8, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=64
    ),
    # GPU machine: wider and deeper, vocab 2048.
    "gpu": ReferenceModelSpec(
        name="gpu",
        vocab_size=2048,
        hidden_size=768,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2048,
        moe_intermediate_size=384,
        num_experts=64,
        num_experts_per_tok=8,
        router_std=0.03,
        lm_head_std=0.03,
    ),
    # Two GPUs: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, top-8,
    # rope theta 1e6) with 4 of its 48 layers and a 2048-token vocabulary: 2.5 B parameters, so the trainer's
    # fp32 weights + grads + AdamW moments (16 B/param, ~40 GB) fit one 80 GB GPU and the bf16 engine another.
    "a3b": ReferenceModelSpec(
        name="a3b",
        vocab_size=2048,
        hidden_size=2048,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        rope_theta=1_000_000.0,
        router_std=0.03,
        lm_head_std=0.03,
    ),
}
# The weight-sync benchmark's larger model (bench_weight_sync --model a3b-x16l): the a3b layer 16 times, 4x its
# parameters (9.8 B, 19.6 GB in bf16), so a sync's fixed cost and its cost per byte separate. Only its
# weights fit one 80 GB GPU in fp32: the benchmark perturbs them between syncs instead of training.
REFERENCE_SPECS["a3b-x16l"] = REFERENCE_SPECS["a3b"].model_copy(update={"name": "a3b-x16l", "num_hidden_layers": 16})


def get_spec(name: str) -> ReferenceModelSpec:
    try:
        return REFERENCE_SPECS[name]
    except KeyError:
        choices = sorted(REFERENCE_SPECS)
        raise ValueError(f"unknown reference model {name!r}; choose one of {choices}") from None


def default_cache_root() -> Path:
    root = runtime_settings().cache_dir or Path.home() / ".cache" / "r3operator"
    return root / "models"


def _std_for(name: str, spec: ReferenceModelSpec) -> float | None:
    """Init std for a tensor; None means "ones" (norm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith("mlp.gate.weight"):
        return spec.router_std
    if name == "lm_head.weight":
        return spec.lm_head_std
    if name.endswith("o_proj.weight") or name.endswith("down_proj"):
        # Scaled residual-branch outputs (GPT-2 style) keep the residual stream from blowing up.
        return spec.init_std / (2 * spec.num_hidden_layers) ** 0.5
    return spec.init_std


def build_state_dict(spec: ReferenceModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """bf16 tensors for every name in `shapes`, reproducible from (seed, name) alone."""
    import numpy as np
    import torch

    out = {}
    for name in sorted(shapes):
        std = _std_for(name, spec)
        if std is None:
            arr = np.ones(shapes[name], dtype=np.float32)
        else:
            rng = np.random.Generator(np.random.PCG64([spec.seed, zlib.crc32(name.encode())]))
            arr = rng.standard_normal(shapes[name], dtype=np.float32) * np.float32(std)
        out[name] = torch.from_numpy(arr).to(torch.bfloat16)
    return out


def _write_model(spec: ReferenceModelSpec, directory: Path) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    config = spec.hf_config()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(build_state_dict(spec, shapes), assign=True, strict=True)
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' decorated `to`, as in hf_policy.py
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory, spec.vocab_size, spec.max_position_embeddings)
    # mkdtemp creates 0700; a shared cache must be readable by the engine's and trainer's users.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    (directory / "r3_reference_spec.json").write_text(
        json.dumps({"generator_version": GENERATOR_VERSION, **spec.model_dump()}, indent=2, sort_keys=True) + "\n"
    )


def place_reference_model(name: str, models_dir: Path) -> Path:
    """Generate reference model `name` under `models_dir` and return ``models_dir/<name>``: the path an engine
    pod's ``vllm serve`` is given (api/vllm_args.model_source), a symlink to the content-addressed directory."""
    target = ensure_reference_model(name, models_dir)
    link = models_dir / name
    if link.is_symlink() and link.readlink() == Path(target.name):
        return link
    if link.exists() and not link.is_symlink():
        raise ValueError(f"{link}: expected a link to a generated reference model, found a real file or directory")
    tmp = models_dir / f".{name}.link-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)  # relative: valid wherever the volume is mounted
    os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one
    return link


def ensure_reference_model(name: str = "tiny", cache_dir: Path | None = None) -> Path:
    """Return the directory of reference model `name`, generating it first if needed.

    Directory: `<cache_dir or $R3OPERATOR_CACHE_DIR/models or ~/.cache/r3operator/models>/<name>-<hash>`.
    Generation writes into a temporary sibling directory and renames it into place, so concurrent
    callers and interrupted runs never see a half-written model.
    """
    spec = get_spec(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"{spec.name}-{spec.content_hash()}"
    if (target / "r3_reference_spec.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _write_model(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process won the race; its copy is identical by construction.
            if not (target / "r3_reference_spec.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
