"""Multi-turn R3 rollouts through the driver's code path (`GRPORun.rollout` → `load_routes` → a step), on
CPU: the real trainer (tiny model) against the in-process fake engine, whose route rows are a function of
the token and position they were computed for, so a row stitched onto the wrong token shows."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job

from r3operator.models.tokenizer import vocabulary
from r3operator.routing.codec import decode

VOCAB = vocabulary(512)
MULTI_TURN = {
    "rollout": {"multiTurn": True, "promptsPerStep": 2, "groupSize": 3, "maxTokens": 3},
    "task": {"name": "guess"},
    "weightSync": {"canary": False},
}


def _run(tmp_path: Path, engine: FakeEngine, **spec: Any) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    job = write_job(tmp_path, **{**MULTI_TURN, **spec})
    return GRPORun(settings_for(job, tmp_path / "runs", steps=2), engines=EngineGroup([engine]))


def _env_spans(sample: Any) -> list[tuple[int, int]]:
    """[begin, end) positions in the sequence of the tokens the loss mask leaves out."""
    offset = len(sample.prompt_token_ids)
    out = np.flatnonzero(~sample.loss_mask) + offset
    spans: list[tuple[int, int]] = []
    for p in out.tolist():
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + 1)
        else:
            spans.append((p, p + 1))
    return spans


def test_multi_turn_routes_land_on_their_tokens_and_env_tokens_leave_the_loss(tmp_path: Path) -> None:
    engine = FakeEngine()
    run = _run(tmp_path, engine)
    run.setup()
    engine.starts_seen.clear()
    samples, problems = run.rollout(1)

    assert len(samples) == 2 * 3 and [s.sample_id for s in samples[:3]] == ["p0-c0", "p0-c1", "p0-c2"]
    turns = [s.extra["turns"] for s in samples]
    assert max(turns) > 1, "no conversation went past its first turn: nothing multi-turn was exercised"
    # Turn 1 asks for every row; turn t > 1 asks only for rows after those already held, i.e. it starts at
    # the previous turn's last sampled token (the boundary row), which sits just before the env reply.
    assert engine.starts_seen[0] == [0] * 6
    assert len(engine.starts_seen) == max(turns)
    for turn_starts in engine.starts_seen[1:]:
        assert all(start > len(problems[0].prompt_ids) for start in turn_starts)

    for sample in samples:
        sequence = sample.sequence
        routes = sample.routes
        assert sample.routes_status == "ok" and routes.start == 0
        # Every position but the last sampled token has its engine row, env tokens included.
        assert routes.end == len(sequence) - 1
        rows = decode(routes)
        for position in range(routes.end):
            np.testing.assert_array_equal(rows[position], engine.route_row(position, sequence[position]))
        # The loss mask drops exactly the env replies: one 3-token reply ("<"|">"|"no", "A", ":") between turns.
        spans = _env_spans(sample)
        assert len(spans) == sample.extra["turns"] - 1 == sample.extra["env_tokens"] // 3
        for begin, end in spans:
            words = [VOCAB[t] for t in sequence[begin:end]]
            assert end - begin == 3 and words[0] in {"<", ">", "no"} and words[1:] == ["A", ":"]
        assert int(sample.loss_mask.sum()) == 3 * sample.extra["turns"]  # maxTokens per model turn
        # Each position is attributed to the turn whose request returned its row: the prompt and turn 1's
        # tokens but the last to turn 1; that boundary token and an env reply to the turn after it.
        turn_of = sample.extra["turn_of"].tolist()
        first = len(problems[0].prompt_ids) + 3
        assert len(turn_of) == len(sequence) and turn_of[:first] == [1] * (first - 1) + [2]
        assert [turn_of[begin] for begin, _ in spans] == list(range(2, sample.extra["turns"] + 1))
        # The boundary rows: each env reply follows a model token whose row only the next turn returned.
        for begin, _ in spans:
            np.testing.assert_array_equal(rows[begin - 1], engine.route_row(begin - 1, sequence[begin - 1]))

    run.recorder.flush()  # the record holds stitched trajectories, not per-turn arrays
    assert [run.store.get(step=1, sample_id=s.sample_id).routes.end for s in samples] == [s.routes.end for s in samples]

    rewards = run.score(samples, problems)
    batch = run.load_routes(1, samples, run.advantages(rewards))
    assert batch is not None and batch.engine_routes is not None and batch.size == 6
    for i, sample in enumerate(samples):
        sequence = sample.sequence
        env_positions = {p for begin, end in _env_spans(sample) for p in range(begin, end)}
        # response_mask column c predicts token c + 1: env tokens are never a target of the loss...
        trained_targets = {c + 1 for c in np.flatnonzero(batch.response_mask[i].numpy()).tolist()}
        assert trained_targets == set(range(len(sample.prompt_token_ids), len(sequence))) - env_positions
        # ...but keep their routes for the context every later token was computed in.
        assert not batch.route_pad[i, sorted(env_positions)].any()
        for position in range(len(sequence) - 1):
            np.testing.assert_array_equal(
                batch.engine_routes[i, position].numpy(), engine.route_row(position, sequence[position])
            )
        assert batch.route_pad[i, len(sequence) - 1 :].all()  # the last sampled token and the pad


def test_a_multi_turn_r3_step_replays_every_route(tmp_path: Path) -> None:
    engine = FakeEngine()
    run = _run(tmp_path, engine)
    run.setup()
    row = run.train_step(1)
    assert row.skipped == 0 and row.samples_dropped == 0
    assert row.replay_applied == 1.0  # the trainer's experts are the stitched engine routes
    assert np.isfinite(row.loss)
    by_turn = row.routing_agreement_by_turn.split(";")
    assert 1 < len(by_turn) <= 4 and row.turns_mean > 1 and row.env_tokens > 0
    assert all(0.0 <= float(x) <= 1.0 for x in by_turn)
    for turn, value in enumerate(by_turn, start=1):  # the same figures, one series per turn, for dashboards
        labels = {"namespace": "default", "rljob": "tiny-count-r3", "turn": str(turn)}
        exported = run.metrics.registry.get_sample_value("r3operator_routing_agreement_by_turn_ratio", labels)
        assert exported == pytest.approx(float(value), abs=1e-4)
    header = (run.run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    turns = header.index("turns_mean")
    assert header[turns : turns + 3] == ["turns_mean", "env_tokens", "routing_agreement_by_turn"]


def test_agreement_by_turn_shows_the_turn_whose_routes_disagree() -> None:
    import torch

    from r3operator.rollout.multiturn import agreement_by_turn

    engine = torch.arange(2 * 6 * 1 * 2).reshape(2, 6, 1, 2) % 32
    natural = engine.clone()
    natural[0, 3:5] = (natural[0, 3:5] + 7) % 32  # sample 0's turn-2 positions disagree
    route_pad = torch.zeros(2, 6, dtype=torch.bool)
    route_pad[:, 5] = True  # the last sampled token
    samples = [
        SimpleNamespace(extra={"turn_of": np.asarray([1, 1, 1, 2, 2, 2])}),
        SimpleNamespace(extra={"turn_of": np.asarray([1, 1, 2, 2])}),
    ]
    # Turn 1: 5 positions, all agree. Turn 2: sample 0's two routed positions disagree, sample 1's agree.
    assert agreement_by_turn(natural, engine, route_pad, samples) == [1.0, 0.5]  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["R2", "Disabled"])
def test_multi_turn_runs_without_replay_too(tmp_path: Path, mode: str) -> None:
    run = _run(tmp_path, FakeEngine(), routingReplay={"mode": mode})
    run.setup()
    row = run.train_step(1)
    assert row.replay_mode == mode and row.skipped == 0 and np.isfinite(row.loss)
    assert row.turns_mean > 1  # the routes still feed the per-turn agreement (metrics only)
    assert len(row.routing_agreement_by_turn.split(";")) > 1


def test_an_engine_that_rewrites_the_conversation_is_refused() -> None:
    from r3operator.rollout.client import build_sample
    from r3operator.rollout.multiturn import Conversation, roll_out_conversations
    from r3operator.routing.errors import RoutingDataError
    from r3operator.tasks.envs import GuessGame

    def generate(prompts: list[list[int]], starts: list[int], turn: int) -> list[Any]:
        echoed = [p if turn == 0 else [p[0], 99, *p[2:]] for p in prompts]  # turn 2 sees other history ids
        return [
            build_sample(
                prompt_index=i,
                choice_index=0,
                prompt_token_ids=e,
                token_ids=[60, 2],
                logprobs=[-1.0, -1.0],
                routed_experts=None,
                routed_experts_prompt_start=s,
                num_experts=32,
            )
            for i, (e, s) in enumerate(zip(echoed, starts, strict=True))
        ]

    conversation = Conversation(prompt_index=0, choice_index=0, prompt=(1, 20, 21), env=GuessGame(3, vocab_size=512))
    with pytest.raises(RoutingDataError, match=r"turn 2: the engine's prompt token ids differ .*R3-RETOKENIZE"):
        roll_out_conversations([conversation], generate, num_experts=32)


def test_a_turn_without_routes_drops_that_conversation(tmp_path: Path) -> None:
    engine = FakeEngine(routes=False)
    run = _run(tmp_path, engine, routingReplay={"onRouteCheckFailure": "SkipSample"})
    run.setup()
    samples, _ = run.rollout(1)
    assert all(
        s.routes is None and s.routes_error.startswith("turn 1: engine returned no routed_experts") for s in samples
    )
    assert run.train_step(1).skipped == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"task": {"name": "count"}}, "spec.rollout.multiTurn: task 'count' has no multi-turn environment"),
        ({"rollout": {"multiTurn": False}}, "spec.task.name: 'guess' is a multi-turn game"),
    ],
)
def test_multi_turn_and_its_task_come_together(tmp_path: Path, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, FakeEngine(), **spec)


def test_engine_group_sends_each_prompt_its_own_start() -> None:
    from r3operator.rollout.engines import EngineGroup

    first, second = FakeEngine(name="a"), FakeEngine(name="b")
    prompts = [[1, 5, 6], [1, 5, 6, 7, 8], [1, 9]]
    samples = EngineGroup([first, second]).generate(
        prompts, max_tokens=2, temperature=1.0, seed=0, n=1, routed_experts_prompt_start=[0, 3, 1]
    )
    assert first.starts_seen == [[0], [1]] and second.starts_seen == [[3]]  # prompts 0, 2 and 1
    assert [(s.sample_id, s.routes.start) for s in samples] == [("p0-c0", 0), ("p1-c0", 3), ("p2-c0", 1)]


def test_http_engine_sends_each_prompt_its_own_start(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    from fake_vllm_server import FakeVLLMServer

    from r3operator.rollout.engines import HTTPEngine

    with FakeVLLMServer() as server:
        engine = HTTPEngine(server.url, staging_dir=tmp_path, num_experts=32)
        prompts = [[1, 5, 6], [1, 5, 6, 7, 8]]
        samples = engine.generate(
            prompts, max_tokens=2, temperature=1.0, seed=0, n=1, routed_experts_prompt_start=[0, 3]
        )
    assert sorted(server.starts) == [0, 3]  # one request per prompt, in parallel
    assert [(s.routes.start, s.routes.num_tokens) for s in samples] == [(0, 3 + 2 - 1), (3, 5 + 2 - 1 - 3)]


def test_each_row_is_attributed_to_the_turn_whose_request_returned_it() -> None:
    """Reference: every request stamps the rows it returns with its own turn number (expert ids turn,
    turn + 10). After stitching, `turn_of` must name that turn at every routed position, the boundary row
    (the previous turn's last sampled token, returned with the next turn's prefill) included."""
    from r3operator.rollout.client import build_sample
    from r3operator.rollout.multiturn import Conversation, roll_out_conversations
    from r3operator.routing.codec import decode
    from r3operator.tasks.envs import GuessGame

    def generate(prompts: list[list[int]], starts: list[int], turn: int) -> list[Any]:
        out = []
        for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            rows = np.tile(np.asarray([turn + 1, turn + 11], dtype=np.int64), (len(prompt) + 2 - 1 - start, 1, 1))
            out.append(
                build_sample(
                    prompt_index=i,
                    choice_index=0,
                    prompt_token_ids=prompt,
                    token_ids=[60, 61],
                    logprobs=[-1.0, -1.0],
                    routed_experts=rows,
                    routed_experts_prompt_start=start,
                    num_experts=32,
                )
            )
        return out

    conversation = Conversation(prompt_index=0, choice_index=0, prompt=(1, 20, 21), env=GuessGame(3, vocab_size=512))
    (sample,) = roll_out_conversations([conversation], generate, num_experts=32)
    assert sample.extra["turns"] > 1 and sample.routes is not None
    stamped = decode(sample.routes)[:, 0, 0]  # the turn whose request returned each routed position
    turn_of = sample.extra["turn_of"][: len(stamped)]
    np.testing.assert_array_equal(turn_of, stamped)
