"""Loaded by every Python process of a verl run (the runner puts this folder first on verl's PYTHONPATH). Two
changes, each made when its module is first imported; nothing else of verl changes:

1. The rollout-vs-trainer |Δlogprob| that r3operator logs, added to verl's step metrics. verl's own
   `training/rollout_probs_diff_*` (verl/utils/debug/metrics.py) is |p_trainer − p_rollout| in probability space,
   which cannot be set next to r3operator's |logp_trainer − logp_rollout|. `calculate_debug_metrics` is wrapped to
   add, from the same batch (`rollout_log_probs`, `old_log_probs`, the response mask), `peer/logprob_abs_diff_mean`
   and `_max` (token-level, over response tokens), `peer/kl_k3` (the formula of verl's own `rollout_corr/k3_kl`) and
   `peer/extreme_token_fraction` (tokens whose trainer/rollout probability ratio is outside [1/2, 2], r3operator's
   `extreme_token_fraction`; verl 0.9.1 counts such tokens only with importance sampling or rejection turned on,
   `rollout_corr/rollout_is_ratio_fraction_*`). A failure there leaves verl's metrics as they are.
2. mbridge 0.15.1 (verl's `vanilla_mbridge` path) reads `hf_config.rope_theta`, which transformers 5 no longer sets
   (it keeps the value in `rope_parameters`); `AutoBridge.from_config` is wrapped to set it from there first.
3. mbridge 0.15.1's `get_model` compares with `ModelType.encoder_and_decoder`, which megatron-core 0.19 removed
   (encoder-decoder models went with it); the name is given back as a value no model type equals.
4. verl's agent loop picks its token builder from `config.json`'s `model_type`: `qwen3_moe` gets the Qwen (ChatML)
   builder, which needs `<|im_end|>` and a one-token newline to mend turn boundaries. The reference models keep
   Qwen3-MoE's architecture but have their own word-level tokenizer and chat template (no ChatML), so a tokenizer
   without `<|im_end|>` gets verl's generic builder instead; single-turn prompts render through the same chat
   template either way.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

EXTREME_LOG_RATIO = math.log(2.0)  # r3operator/trainer/metrics.py: EXTREME_RATIO_TAU


def logprob_metrics(batch: Any) -> dict[str, float]:
    rollout = batch["rollout_log_probs"].float()
    trainer = batch["old_log_probs"].float()
    length = batch["responses"].size(1)
    mask = (batch["response_mask"] if "response_mask" in batch else batch["attention_mask"])[:, -length:].bool()
    if not bool(mask.any()):
        return {}
    log_ratio = (trainer - rollout)[mask]
    k3 = (log_ratio.exp() - 1 - log_ratio).mean()  # KL(rollout || trainer), as r3operator's kl_k3
    return {
        "peer/logprob_abs_diff_mean": float(log_ratio.abs().mean()),
        "peer/logprob_abs_diff_max": float(log_ratio.abs().max()),
        "peer/kl_k3": float(k3),
        "peer/extreme_token_fraction": float((log_ratio.abs() > EXTREME_LOG_RATIO).float().mean()),
    }


def _wrap_debug_metrics(module: Any) -> None:
    original = module.calculate_debug_metrics

    def calculate_debug_metrics(data: Any) -> dict[str, Any]:
        metrics = original(data)
        try:
            metrics.update(logprob_metrics(data.batch))
        except Exception as exc:  # a measurement aid must not stop the run it measures
            print(f"verl_hook: no peer/logprob metrics ({type(exc).__name__}: {exc})", file=sys.stderr)
        return metrics

    module.calculate_debug_metrics = calculate_debug_metrics


def with_rope_theta(hf_config: Any) -> Any:
    """`hf_config` with the `rope_theta` attribute transformers 4 had, taken from `rope_parameters`."""
    params = getattr(hf_config, "rope_parameters", None)
    if getattr(hf_config, "rope_theta", None) is None and isinstance(params, dict) and "rope_theta" in params:
        hf_config.rope_theta = params["rope_theta"]
    return hf_config


def _wrap_auto_bridge(module: Any) -> None:
    original = module.AutoBridge.from_config.__func__

    def from_config(cls: Any, /, hf_config: Any, **kwargs: Any) -> Any:
        return original(cls, with_rope_theta(hf_config), **kwargs)

    module.AutoBridge.from_config = classmethod(from_config)


class _NoSuchModelType:
    """megatron-core 0.19 has no encoder-decoder model type: nothing compares equal to this."""


def _give_back_encoder_and_decoder(module: Any) -> None:
    model_type = getattr(module, "ModelType", None)
    if model_type is not None and not hasattr(model_type, "encoder_and_decoder"):
        setattr(model_type, "encoder_and_decoder", _NoSuchModelType())  # noqa: B010 (an Enum class: no member)


CHATML_END = "<|im_end|>"


def _generic_builder_without_chatml(module: Any) -> None:
    original = module.create_continuous_token_builder

    def create_continuous_token_builder(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("model_family", "auto") == "auto" and CHATML_END not in tokenizer.get_vocab():
            kwargs["model_family"] = "default"
        return original(tokenizer, *args, **kwargs)

    module.create_continuous_token_builder = create_continuous_token_builder


PATCHES = {
    "verl.utils.debug.metrics": _wrap_debug_metrics,
    "mbridge.core.auto_bridge": _wrap_auto_bridge,
    "mbridge.core.util": _give_back_encoder_and_decoder,
    "verl.utils.tokenizer.continuous_token_wiring": _generic_builder_without_chatml,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def run_shadowed_sitecustomize() -> None:
    """Python imports one `sitecustomize`, the first on the path: this one shadows the image's, if it has one,
    so that one runs here."""
    here = Path(__file__).resolve().parent
    for entry in sys.path:
        candidate = Path(entry or ".") / "sitecustomize.py"
        if candidate.resolve().parent == here or not candidate.is_file():
            continue
        spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


sys.meta_path.insert(0, _Finder())
run_shadowed_sitecustomize()
