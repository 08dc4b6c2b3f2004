"""Loaded by every Python process of a verl run (the runner puts this folder first on verl's PYTHONPATH): adds
the rollout-vs-trainer |Δlogprob| that r3operator logs to verl's step metrics.

verl's own `training/rollout_probs_diff_*` (verl/utils/debug/metrics.py) is |p_trainer − p_rollout| in
probability space, which cannot be set next to r3operator's |logp_trainer − logp_rollout|. When the module
`verl.utils.debug.metrics` is imported, its `calculate_debug_metrics` is wrapped to add, from the same batch
(`rollout_log_probs`, `old_log_probs`, the response mask), `peer/logprob_abs_diff_mean` and `_max` (token-level,
over response tokens) and `peer/kl_k3`. Nothing else of verl changes; any failure here leaves verl as shipped.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

TARGET = "verl.utils.debug.metrics"


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
    }


def _wrap(module: Any) -> None:
    original = module.calculate_debug_metrics

    def calculate_debug_metrics(data: Any) -> dict:
        metrics = original(data)
        try:
            metrics.update(logprob_metrics(data.batch))
        except Exception as exc:  # a measurement aid must not stop the run it measures
            print(f"verl_hook: no peer/logprob metrics ({type(exc).__name__}: {exc})", file=sys.stderr)
        return metrics

    module.calculate_debug_metrics = calculate_debug_metrics


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            _wrap(module)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Finder())
