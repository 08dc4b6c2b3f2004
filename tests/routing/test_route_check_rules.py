"""The route-check rules (routing/checks.py) on arrays built by hand, against the rule as written out here."""

from __future__ import annotations

import numpy as np
import pytest

from r3operator.routing import checks
from r3operator.routing.checks import ModelRouting

# 4 decoder layers, layer 0 dense (vLLM reports it as zero rows), top-2 of 8 experts.
MODEL = ModelRouting(num_layers=4, top_k=2, num_experts=8, moe_layers=(1, 2, 3))


def _routes(tokens: int = 5) -> np.ndarray:
    ids = np.zeros((tokens, 4, 2), dtype=np.int64)
    for t in range(tokens):
        for layer in (1, 2, 3):
            ids[t, layer] = [(t + layer) % 8, (t + layer + 3) % 8]
    return ids


def test_well_formed_routes_pass_with_their_dense_layer_all_zero() -> None:
    assert checks.check_sample_routes("s", _routes(), MODEL) is None


@pytest.mark.parametrize("shape", [(5, 3, 2), (5, 4, 3), (5, 4)])
def test_routes_of_another_model_shape_fail_route_shape(shape: tuple[int, ...]) -> None:
    failure = checks.check_sample_routes("s", np.zeros(shape, dtype=np.int64), MODEL)
    assert failure is not None and failure.rule == "route-shape" and failure.layer is None
    assert "[tokens, 4 layers, top-k 2]" in failure.detail


def test_a_physical_expert_id_fails_expert_range_naming_token_and_layer() -> None:
    ids = _routes()
    ids[3, 2] = [1, 8]  # 8 == numExperts: an EPLB redundant slot, not a logical expert
    failure = checks.check_sample_routes("p1-c0", ids, MODEL)
    assert failure is not None and (failure.rule, failure.sample_id, failure.layer) == ("expert-range", "p1-c0", 2)
    assert "token 3 holds expert ids [1, 8], outside [0, 8)" in failure.detail
    assert str(failure).startswith("route check expert-range failed (sample p1-c0, layer 2): ")


def test_an_uncaptured_row_on_an_moe_layer_fails_zero_route() -> None:
    ids = _routes()
    ids[2:, 3] = 0  # the last 3 tokens of layer 3 were never written
    failure = checks.check_sample_routes("s", ids, MODEL)
    assert failure is not None and (failure.rule, failure.layer) == ("zero-route", 3)
    assert failure.detail.startswith("3 of 5 captured rows hold one expert 2 times (token 2: [0, 0])")


def test_one_expert_is_a_real_route_when_top_k_is_one() -> None:
    model = ModelRouting(num_layers=2, top_k=1, num_experts=4, moe_layers=(0, 1))
    assert checks.check_sample_routes("s", np.zeros((3, 2, 1), dtype=np.int64), model) is None


def test_a_replayed_pad_column_or_last_token_fails_pad_replayed() -> None:
    # Two samples of lengths 5 and 3 in a batch of width 5; the engine sent rows [0, 4) and [0, 2).
    good = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=bool)
    assert checks.check_replay_mask(["a", "b"], [5, 3], good, [(0, 4), (0, 2)]) == []
    pad = good.copy()
    pad[1, 4] = True  # a pad column of sample b
    last = good.copy()
    last[0, 4] = True  # sample a's last token, which the engine never forwarded
    [p] = checks.check_replay_mask(["a", "b"], [5, 3], pad, [(0, 4), (0, 2)])
    [q] = checks.check_replay_mask(["a", "b"], [5, 3], last, [(0, 4), (0, 2)])
    assert (p.rule, p.sample_id) == ("pad-replayed", "b") and "position 4 (a pad column)" in p.detail
    assert (q.rule, q.sample_id) == ("pad-replayed", "a") and "position 4 (its last token)" in q.detail
    prefix = good.copy()
    [r] = checks.check_replay_mask(["a", "b"], [5, 3], prefix, [(2, 4), (0, 2)])  # rows start at 2
    assert r.sample_id == "a" and "position 0 (a token)" in r.detail


def test_a_constant_layer_fails_only_where_the_trainers_own_routing_varies() -> None:
    engine = _routes()[None].copy()  # [1, 5, 4, 2]
    natural = engine.copy()
    engine[0, :, 2] = [4, 6]  # every row of layer 2 routes to one expert set
    replayed = np.ones((1, 5), dtype=bool)
    [failure] = checks.check_constant_layers(["s"], engine, natural, replayed, MODEL.moe_layers)
    assert (failure.rule, failure.layer) == ("constant-layer", 2)
    assert (
        "all 5 replayed rows route to experts [4, 6]" in failure.detail and "5 different expert sets" in failure.detail
    )
    natural[0, :, 2] = [6, 4]  # the trainer's routers are constant there too: nothing silent
    assert checks.check_constant_layers(["s"], engine, natural, replayed, MODEL.moe_layers) == []
    one_row = np.array([[True, False, False, False, False]])
    assert checks.check_constant_layers(["s"], engine, _routes()[None], one_row, MODEL.moe_layers) == []


def test_a_layer_whose_hook_never_ran_on_some_rank_fails_hooks_not_fired() -> None:
    expected = {0: (1, 2, 3), 1: (1, 2, 3)}
    assert checks.check_hooks_fired(expected, {0: {1: 2, 2: 2, 3: 2}, 1: {1: 1, 2: 1, 3: 1}}) is None
    failure = checks.check_hooks_fired(expected, {0: {1: 2, 2: 2, 3: 2}, 1: {1: 1, 2: 0, 3: 1}})
    assert failure is not None and (failure.rule, failure.sample_id, failure.layer) == ("hooks-not-fired", None, 2)
    assert "on 1 MoE layer(s) (rank 1 layer 2)" in failure.detail
    missing_rank = checks.check_hooks_fired(expected, {0: {1: 2, 2: 2, 3: 2}})
    assert missing_rank is not None and "on 3 MoE layer(s)" in missing_rank.detail


def test_replay_fractions_are_rows_over_rows() -> None:
    # Rollout: samples of 6, 4 and 5 tokens need 5 + 3 + 4 = 12 rows; the third was skipped; the two trained
    # ones need 8 rows, of which 7 replayed (one uncaptured prefix row).
    f = checks.replay_fractions(replayed_rows=7, trained_rows=8, needed_rows=12)
    assert f.replayed == pytest.approx(7 / 12) and f.fallback == pytest.approx(1 / 8)
    empty = checks.replay_fractions(replayed_rows=0, trained_rows=0, needed_rows=0)
    assert np.isnan(empty.replayed) and np.isnan(empty.fallback)
