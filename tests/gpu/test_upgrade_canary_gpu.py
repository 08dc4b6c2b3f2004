"""GPU: the engine-upgrade canary scoring two real CUDA vLLM servers with the real trainer on the GPU.

    PYTHONPATH=/tmp/site:. python3 -m pytest tests/gpu/test_upgrade_canary_gpu.py -m gpu -q

The CPU test (tests/runtime/test_upgrade_canary_vllm.py) on the GPU stack: one server serves the tiny
reference model, the other a copy with every router replaced by noise (a new engine that routes
differently). Both share GPU 0 (a tenth of it each, fp32: the tiny model needs little). The same server as
old and new passes; the perturbed one as new fails, its natural mismatch far above the old engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_server import VLLMServer, perturbed_router_copy, upgrade_canary_settings

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from r3operator.models import ensure_reference_model

    tiny = ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))
    bad = perturbed_router_copy(tiny, tmp_path_factory.mktemp("bad") / "model")
    share = ("--gpu-memory-utilization", "0.1")
    started = {}
    try:
        for role, model in (("good", tiny), ("bad", bad)):
            # One at a time: each sizes its KV cache from the GPU memory free when it starts.
            started[role] = VLLMServer(
                model, tmp_path_factory.mktemp(f"serve-{role}") / "server.log", max_model_len=256, extra_args=share
            )
            started[role].wait_healthy()
        yield {"urls": {role: server.url for role, server in started.items()}, "model": tiny}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def settings(servers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    return upgrade_canary_settings(tmp_path_factory, servers["model"], device="cuda")


def test_the_same_engine_as_old_and_new_passes_on_the_gpu(servers: dict[str, Any], settings: Any) -> None:
    from r3operator.runtime.upgrade_canary import run_upgrade_canary

    good = servers["urls"]["good"]
    result = run_upgrade_canary(settings, old_url=good, new_url=good, old_image="old", new_image="new", attempt="1")
    assert result.passed, result.message
    assert result.new is not None and result.new.routes_valid and result.new.replay_agreement == 1.0


def test_an_engine_that_routes_differently_fails_on_the_gpu(servers: dict[str, Any], settings: Any) -> None:
    from r3operator.runtime.upgrade_canary import run_upgrade_canary

    urls = servers["urls"]
    result = run_upgrade_canary(
        settings, old_url=urls["good"], new_url=urls["bad"], old_image="good:1", new_image="bad:2", attempt="2"
    )
    assert not result.passed
    assert result.new is not None and result.old is not None
    assert result.new.natural_mismatch is not None and result.old.natural_mismatch is not None
    assert result.new.natural_mismatch > 10 * max(result.old.natural_mismatch, 0.01)
