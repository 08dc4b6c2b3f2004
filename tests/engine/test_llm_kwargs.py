"""The in-process engine's vLLM arguments: the GPU share follows the job when the user set one."""

from __future__ import annotations

from r3operator.engine.llm import SHARED_GPU_FRACTION, llm_kwargs


def test_gpu_share_is_half_unless_the_job_names_one() -> None:
    assert llm_kwargs("m", device="cuda")["gpu_memory_utilization"] == SHARED_GPU_FRACTION
    assert llm_kwargs("m", device="cuda", gpu_memory_utilization=0.25)["gpu_memory_utilization"] == 0.25


def test_cpu_engines_get_no_gpu_share() -> None:
    assert "gpu_memory_utilization" not in llm_kwargs("m", device="cpu", gpu_memory_utilization=0.25)
