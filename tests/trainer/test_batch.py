"""The one batch builder: right padding, response columns, and routes placed at their absolute positions."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from r3operator.routing.codec import RoutedExperts, encode  # noqa: E402
from r3operator.routing.sample import RolloutSample  # noqa: E402
from r3operator.trainer.batch import build_batch  # noqa: E402

L, K, E = 3, 2, 8


def distinct_routes(rows: int, *, seed: int, num_experts: int = E) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, L, num_experts)), axis=-1)[..., :K].astype(np.int64)


def sample(sid: str, prompt: list[int], gen: list[int], routes: RoutedExperts | None) -> RolloutSample:
    return RolloutSample(
        sample_id=sid,
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=tuple(prompt),
        token_ids=tuple(gen),
        logprobs=np.linspace(-1.0, -0.1, len(gen), dtype=np.float32),
        routes=routes,
        routed_experts_prompt_start=0 if routes is None else routes.start,
    )


def test_right_padding_and_response_columns() -> None:
    a = sample("a", [5, 6, 7], [8, 9], None)
    b = sample("b", [5, 6], [8], None)
    batch = build_batch([a, b], [1.0, -1.0], routes=None, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # logprob column t predicts token t+1: the first response token of a P-token prompt is column P-1.
    assert batch.response_mask.tolist() == [[False, False, True, True], [False, True, False, False]]
    assert batch.rollout_logprobs[0, 2:].tolist() == pytest.approx(a.logprobs.tolist())
    assert batch.engine_routes is None and batch.route_pad is None


def test_routes_with_prompt_start_land_on_their_own_tokens() -> None:
    """routed_experts_prompt_start = 2: route row r belongs to absolute position 2 + r, not r."""
    prompt, gen = [11, 12, 13, 14, 15, 16], [17, 18, 19]
    rows = distinct_routes(len(prompt) + len(gen) - 1 - 2, seed=1)  # positions [2, 8)
    with_start = sample("s", prompt, gen, encode(rows, start=2, num_experts=E))
    whole = distinct_routes(4 + 2 - 1, seed=2)  # a shorter sample (4 + 2 tokens), every row captured
    plain = sample("p", prompt[:4], gen[:2], encode(whole, num_experts=E))
    batch = build_batch([with_start, plain], [0.5, -0.5], routes=[with_start.routes, plain.routes], pad_id=0)
    assert batch.engine_routes is not None and batch.route_pad is not None
    assert batch.engine_routes.shape == (2, 9, L, K) and batch.engine_routes.dtype == torch.int64
    np.testing.assert_array_equal(batch.engine_routes[0, 2:8].numpy(), rows)
    assert batch.route_pad[0].tolist() == [True, True] + [False] * 6 + [True]  # prefix and last token: no route
    np.testing.assert_array_equal(batch.engine_routes[1, :5].numpy(), whole)
    assert batch.route_pad[1].tolist() == [False] * 5 + [True] * 4
    assert (batch.engine_routes[batch.route_pad] == 0).all()  # no-route rows carry no ids, only the mask


def test_samples_of_different_route_dtypes_share_one_int64_batch() -> None:
    narrow = distinct_routes(3, seed=3)
    wide = distinct_routes(4, seed=4, num_experts=300)
    a = sample("a", [1, 2], [3, 4], encode(narrow, num_experts=E))
    b = sample("b", [1, 2], [3, 4, 5], encode(wide, num_experts=300))
    assert (a.routes.dtype, b.routes.dtype) == ("uint8", "uint16")
    batch = build_batch([a, b], [0.0, 0.0], routes=[a.routes, b.routes], pad_id=0)
    np.testing.assert_array_equal(batch.engine_routes[1, :4].numpy(), wide)


def test_routes_past_the_sample_and_mismatched_shapes_are_refused() -> None:
    too_long = sample("long", [1, 2], [3], encode(distinct_routes(3, seed=5), start=1, num_experts=E))
    with pytest.raises(ValueError, match=r"'long' cover positions \[1, 4\) but the sample has 3 tokens"):
        build_batch([too_long], [0.0], routes=[too_long.routes], pad_id=0)
    ok = sample("ok", [1, 2], [3], encode(distinct_routes(2, seed=6), num_experts=E))
    other = encode(np.zeros((2, L + 1, K), dtype=np.int64) + np.arange(K), num_experts=E)
    with pytest.raises(ValueError, match=r"differ in \(layers, top_k\)"):
        build_batch([ok, ok], [0.0, 0.0], routes=[ok.routes, other], pad_id=0)
    with pytest.raises(ValueError, match="2 samples but 1 route arrays"):
        build_batch([ok, ok], [0.0, 0.0], routes=[ok.routes], pad_id=0)


@pytest.mark.slow
def test_replayed_experts_follow_the_prompt_start_through_the_hf_hook() -> None:
    """End to end through RouterReplay: the token at absolute position p receives route row p - start."""
    from tiny_moe import build_tiny_moe

    from r3operator.trainer.replay.hf import RouterRecorder, RouterReplay

    model = build_tiny_moe("qwen3_moe")  # 3 layers, 8 experts, top-2: the shape of distinct_routes
    prompt, gen, start = [11, 12, 13, 14, 15], [16, 17, 18], 3
    rows = distinct_routes(len(prompt) + len(gen) - 1 - start, seed=7)
    s = sample("s", prompt, gen, encode(rows, start=start, num_experts=E))
    batch = build_batch([s], [0.0], routes=[s.routes], pad_id=0)
    replay = RouterReplay().install(model)
    used = RouterRecorder(natural=False).install(model)
    with replay.armed(batch.engine_routes, padding_mask=batch.route_pad), torch.no_grad():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    for layer in range(L):
        got = used.records[layer][start : start + len(rows)]
        np.testing.assert_array_equal(got.numpy(), rows[:, layer])


def test_loss_mask_takes_env_tokens_out_of_the_loss_but_not_out_of_the_routes() -> None:
    """A multi-turn trajectory: model turn [8, 9], env reply [40, 41], model turn [10]."""
    prompt, gen = [5, 6, 7], [8, 9, 40, 41, 10]
    rows = distinct_routes(len(prompt) + len(gen) - 1, seed=4)
    traj = RolloutSample(
        sample_id="t",
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=tuple(prompt),
        token_ids=tuple(gen),
        logprobs=np.asarray([-0.5, -0.4, 0.0, 0.0, -0.3], dtype=np.float32),
        routes=encode(rows, num_experts=E),
        loss_mask=np.asarray([True, True, False, False, True]),
    )
    batch = build_batch([traj], [1.0], routes=[traj.routes], pad_id=0)
    # Column c predicts token c + 1: targets 8, 9 and 10 are trained, the env's 40 and 41 are not.
    assert batch.response_mask.tolist() == [[False, False, True, True, False, False, True]]
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.5, -0.4, 0, 0, -0.3])
    assert batch.input_ids[0].tolist() == prompt + gen  # the env tokens stay in the context
    assert batch.route_pad[0].tolist() == [False] * 7 + [True]  # and keep their routes
    np.testing.assert_array_equal(batch.engine_routes[0, :7].numpy(), rows)


def test_loss_mask_of_the_wrong_length_is_refused() -> None:
    bad = RolloutSample(
        sample_id="bad",
        prompt_index=0,
        choice_index=0,
        prompt_token_ids=(5, 6),
        token_ids=(7, 8),
        logprobs=np.zeros(2, dtype=np.float32),
        routes=None,
        loss_mask=np.asarray([True]),
    )
    with pytest.raises(ValueError, match="sample 'bad' has a loss mask of 1 entries for 2 generated tokens"):
        build_batch([bad], [1.0], routes=None, pad_id=0)
