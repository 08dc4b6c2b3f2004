"""Helpers for the runtime tests: the embedded example shrunk to a few prompts/tokens."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rljob-local.yaml"


def small_job_manifest(**spec_overrides: Any) -> dict[str, Any]:
    """The embedded example, shrunk to few prompts/tokens so a step takes seconds on 2 cores."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    spec = manifest["spec"]
    spec["rollout"].update({"promptsPerStep": 4, "groupSize": 4, "maxTokens": 4})
    spec["algorithm"].update({"steps": 2, "sftWarmupSteps": 0, "miniBatches": 1})
    spec["checkpoint"].update({"intervalSteps": 1})
    for key, value in spec_overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    return manifest


def write_job(tmp_path: Path, **spec_overrides: Any) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_job_manifest(**spec_overrides)))
    return path


def settings_for(job_path: Path, run_dir: Path, **kwargs: Any) -> Any:
    from r3operator.runtime.app import build_settings

    settings = build_settings(job_path, out_dir=run_dir, device="cpu", **kwargs)
    settings.show_progress = False
    return copy.copy(settings)


# One MoE layer's trainer tensors (transformers 5: experts fused), experts E, intermediate I, hidden H; what a vLLM
# 0.22 engine makes of them: qkv_proj [16, H], experts.w13_weight [E, 2I, H], experts.w2_weight [E, H, I].
MOE_E, MOE_I, MOE_H = 4, 3, 8
MOE_LAYER_SHAPES: dict[str, tuple[int, ...]] = {
    "model.layers.0.self_attn.q_proj.weight": (8, MOE_H),
    "model.layers.0.self_attn.k_proj.weight": (4, MOE_H),
    "model.layers.0.self_attn.v_proj.weight": (4, MOE_H),
    "model.layers.0.mlp.experts.gate_up_proj": (MOE_E, 2 * MOE_I, MOE_H),
    "model.layers.0.mlp.experts.down_proj": (MOE_E, MOE_H, MOE_I),
}
