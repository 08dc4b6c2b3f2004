"""A disaggregated engine group under the weight-sync supervisor: both roles are synced, canaried and checked for the
current policy; a prefill engine a version behind its decode engine is re-synced and canaried before a rollout; a
prefill engine is paired only with decode engines of its own build."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from fake_engine import FakeEngine

from r3operator.rollout.disaggregated import DisaggregatedGroup
from r3operator.weightsync.faults import EngineSupervisor
from r3operator.wire.retry import Backoff, EngineUnavailableError


@dataclass
class BuiltEngine(FakeEngine):
    build: str = "vllm 0.30.0 image engine:a"

    def engine_build(self) -> str:
        return self.build


def _chunks() -> list[Any]:
    import torch

    from r3operator.wire.weights import pack_chunk

    return [pack_chunk([("layer.weight", torch.ones(2, 2))])]


def _supervised(prefill: FakeEngine, decode: FakeEngine, canaried: list[list[str]]) -> EngineSupervisor:
    group = DisaggregatedGroup([prefill], [decode])  # type: ignore[list-item]  # the fakes stand in for HTTPEngine

    def canary(engines: Any) -> None:
        canaried.append([e.name for e in engines])

    backoff = Backoff(attempts=2, base_s=0.0, jitter=0.0, sleep=lambda s: None)
    return EngineSupervisor(group, chunks=_chunks, canary=canary, backoff=backoff, nonce="run1")


def test_a_sync_reaches_both_roles_and_a_prefill_engine_a_version_behind_is_resynced_before_a_rollout() -> None:
    prefill, decode = BuiltEngine(name="prefill-0"), BuiltEngine(name="engine-0")
    canaried: list[list[str]] = []
    supervisor = _supervised(prefill, decode, canaried)
    supervisor.sync(1)
    supervisor.sync(2)
    assert prefill.tag == decode.tag == "run1:2"
    assert prefill.calls.count("finish") == decode.calls.count("finish") == 2  # one bracket each per sync

    prefill.tag = "run1:1"  # the prefill engine serves the previous policy (its last sync did not hold)
    served: list[str | None] = []
    supervisor.on_policy(lambda: served.append(prefill.tag), what="rollout")
    assert served == ["run1:2"]  # re-synced before the rollout ran, never after
    assert canaried == [["prefill-0"]]  # and canaried alone: the decode engine was current

    prefill.tag = "run1:1"
    from r3operator.rollout.base import StaleEngineError

    with pytest.raises(StaleEngineError):  # the asynchronous producer's calls refuse instead of re-syncing
        supervisor.current_only(lambda: None, what="segment")


def test_a_prefill_engine_serves_only_with_a_decode_engine_of_its_build() -> None:
    old_p, new_p = BuiltEngine(name="prefill-0"), BuiltEngine(name="prefill-1", build="vllm 0.30.1 image engine:b")
    old_d, new_d = BuiltEngine(name="engine-0"), BuiltEngine(name="engine-1", build="vllm 0.30.1 image engine:b")
    group = DisaggregatedGroup([old_p, new_p], [old_d, new_d])  # type: ignore[list-item]
    assert [(p.name, d.name) for p, d in group.pairs()] == [("prefill-0", "engine-0"), ("prefill-1", "engine-1")]

    new_p.build = old_p.build  # the prefill role rolled back, the decode engine 1 did not: it gets no request
    assert [(p.name, d.name) for p, d in group.pairs()] == [("prefill-0", "engine-0")]

    old_d.build = new_d.build  # every decode engine on b, every prefill engine on a: nothing may serve
    with pytest.raises(EngineUnavailableError, match="no prefill engine shares a build with a decode engine"):
        group.pairs()


def test_a_group_needs_both_roles() -> None:
    with pytest.raises(ValueError, match="needs both roles, got 0 prefill, 1 decode"):
        DisaggregatedGroup([], [BuiltEngine()])  # type: ignore[list-item]


class _Client:
    """What DisaggregatedGroup.one asks of an engine's HTTP client, answering from `answers` (one per request)."""

    num_experts = 32

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = answers
        self.bodies: list[dict[str, Any]] = []

    def completion_body(self, prompt: Any, **fields: Any) -> dict[str, Any]:
        return {"prompt": list(prompt), **fields}

    def request(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return self.answers.pop(0)


def _npy(rows: Any) -> str:
    import base64
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.asarray(rows, dtype=np.int32))
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass
class _Engine:
    client: Any
    name: str


def _pd_sample(
    prompt: list[int], generated: list[int], *, prefill_rows: Any, decode_rows: Any, start: int
) -> tuple[Any, _Client, _Client]:
    """`DisaggregatedGroup.one` over a prefill and a decode engine answering these rows; the sample and both clients."""
    prefill = _Client(
        [{"choices": [{"token_ids": [11], "routed_experts": _npy(prefill_rows)}], "kv_transfer_params": {"x": 1}}]
    )
    logprobs = {"token_logprobs": [-0.1] * len(generated)}
    decode_client = _Client(
        [{"choices": [{"token_ids": generated, "logprobs": logprobs, "routed_experts": _npy(decode_rows)}]}]
    )
    group = DisaggregatedGroup([_Engine(prefill, "p")], [_Engine(decode_client, "d")])  # type: ignore[list-item]
    sample = group.one(
        group.prefill[0],
        group.decode[0],
        prompt,
        prompt_index=0,
        choice_index=0,
        max_tokens=len(generated),
        temperature=0.0,
        seed=1,
        start=start,
    )
    return sample, prefill, decode_client


def test_a_decode_engine_that_answers_every_row_has_its_stale_prompt_rows_dropped() -> None:
    """vLLM before 0.30 takes routed_experts_prompt_start only in SamplingParams: over HTTP the decode engine answers
    rows from 0, those of the loaded prompt tokens stale. The sample keeps the prefill engine's rows for the prompt."""
    import numpy as np

    from r3operator.routing import decode

    rng = np.random.default_rng(0)
    prompt, generated = [1, 5, 9, 4, 7], [11, 12, 13]
    truth = np.stack([rng.permutation(32)[:4].reshape(1, 4).repeat(4, 0) for _ in range(7)])  # [P + G - 1, 4, 4]
    stale = truth.copy()
    stale[:4] = (truth[:4] + 1) % 32  # what the decode engine's slots held for the rows it loaded
    sample, prefill, decode_client = _pd_sample(prompt, generated, prefill_rows=truth[:5], decode_rows=stale, start=0)
    assert sample.routes is not None, sample.routes_error
    np.testing.assert_array_equal(decode(sample.routes), truth)
    assert decode_client.bodies[0]["start"] == len(prompt) - 1 and decode_client.bodies[0]["kv_transfer_params"] == {
        "x": 1
    }
    assert prefill.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True and prefill.bodies[0]["max_tokens"] == 1


@pytest.mark.parametrize("honoured", [True, False], ids=["vllm-0.30+", "before-0.30"])
def test_a_continuation_keeps_only_the_rows_it_asked_for_whichever_release_answers(honoured: bool) -> None:
    """A multi-turn turn or a partial rollout's next segment asks for rows from `start` > 0. A vLLM before 0.30 ignores
    that on /v1/completions and answers the prefill's and the decode's rows from 0 (on an H100 with vLLM 0.22.1 the
    prefill's answer labelled from `start` made the sample's routes unusable, 2026-12-08): both releases must give
    the record of rows [start, P + G - 1)."""
    import numpy as np

    from r3operator.routing import decode

    rng = np.random.default_rng(1)
    prompt, generated, start = [1, 5, 9, 4, 7, 2], [11, 12], 4
    truth = np.stack([rng.permutation(32)[:4].reshape(1, 4).repeat(4, 0) for _ in range(7)])  # [P + G - 1, 4, 4]
    last = len(prompt) - 1
    prefill_rows = truth[start : len(prompt)] if honoured else truth[: len(prompt)]
    decode_rows = truth[last:] if honoured else truth
    sample, prefill, _ = _pd_sample(prompt, generated, prefill_rows=prefill_rows, decode_rows=decode_rows, start=start)
    assert sample.routes is not None, sample.routes_error
    assert sample.routes.start == start
    np.testing.assert_array_equal(decode(sample.routes), truth[start:])
    assert prefill.bodies[0]["start"] == start


@pytest.mark.parametrize("honoured", [True, False], ids=["vllm-0.30+", "before-0.30"])
def test_one_engines_continuation_keeps_only_the_rows_it_asked_for(honoured: bool) -> None:
    import numpy as np

    from r3operator.rollout.client import build_sample
    from r3operator.routing import decode

    rng = np.random.default_rng(2)
    prompt, generated, start = [1, 5, 9, 4, 7, 2], [11, 12, 13], 3
    truth = np.stack([[rng.permutation(32)[:4] for _ in range(4)] for _ in range(len(prompt) + len(generated) - 1)])
    sample = build_sample(
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=prompt,
        token_ids=generated,
        logprobs=[-0.5] * 3,
        routed_experts=_npy(truth[start:] if honoured else truth),
        routed_experts_prompt_start=start,
        num_experts=32,
    )
    assert sample.routes is not None, sample.routes_error
    assert sample.routes.start == start
    np.testing.assert_array_equal(decode(sample.routes), truth[start:])
