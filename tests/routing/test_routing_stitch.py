"""Stitching multi-turn and partial-rollout routes, row-count checks."""

from __future__ import annotations

import numpy as np
import pytest
from r3r_test_helpers import make_routes

from r3operator.routing import (
    RoutedExperts,
    RoutingDataError,
    TrajectoryRoutes,
    check_row_count,
    encode,
)

L, K, E = 4, 3, 64


def _chunk(rows: int, *, start: int = 0, seed: int = 0, num_experts: int = E) -> tuple[np.ndarray, RoutedExperts]:
    arr = make_routes(rows, L, K, num_experts, seed=seed)
    return arr, encode(arr, start=start)


def test_check_row_count_off_by_one() -> None:
    _, routes = _chunk(9)  # prompt 6 + generated 4 - 1 = 9
    check_row_count(routes, prompt_len=6, generated_len=4)
    for prompt_len, generated_len in ((6, 5), (6, 3), (7, 4)):
        with pytest.raises(RoutingDataError, match="expected"):
            check_row_count(routes, prompt_len=prompt_len, generated_len=generated_len)
    _, delta = _chunk(4, start=5)  # 6 + 4 - 1 - 5
    check_row_count(delta, prompt_len=6, generated_len=4)


def test_single_turn_and_wrong_row_count_invalidates() -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    arr, routes = _chunk(7)
    traj.add_turn(prompt_ids=[1, 2, 3, 4], generated_ids=[5, 6, 7, 8], routes=routes)
    assert traj.valid and traj.captured_len == 7 and traj.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    np.testing.assert_array_equal(traj.array(), arr)

    short = TrajectoryRoutes(num_layers=L, top_k=K)
    short.add_turn(prompt_ids=[1, 2, 3, 4], generated_ids=[5, 6, 7, 8], routes=_chunk(8)[1])  # one row too many
    assert not short.valid and "8 rows, expected" in (short.invalid_reason or "")
    with pytest.raises(RoutingDataError, match="invalid"):
        short.array()


@pytest.mark.parametrize("start", [0, 5, 6])
def test_multi_turn_overwrites_boundary_row_and_keeps_rows_before_start(start: int) -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    turn1, routes1 = _chunk(6, seed=1)  # prompt 4 + gen 3 - 1: position 6 (last sampled token) has no route
    traj.add_turn(prompt_ids=[1, 2, 3, 4], generated_ids=[5, 6, 7], routes=routes1)
    assert traj.captured_len == 6
    prompt2 = [1, 2, 3, 4, 5, 6, 7, 20, 21]  # history + two observation tokens
    full2 = make_routes(10, L, K, E, seed=2)  # engine's view of positions 0..9 (prompt 9 + gen 2 - 1)
    traj.add_turn(prompt_ids=prompt2, generated_ids=[30, 31], routes=encode(full2[start:], start=start))
    assert traj.valid and traj.captured_len == 10 and len(traj.tokens) == 11
    out = traj.array()
    np.testing.assert_array_equal(out[:start], turn1[:start])  # stored rows before start are kept
    np.testing.assert_array_equal(out[start:], full2[start:])  # includes the boundary row 6, now prefilled
    np.testing.assert_array_equal(out[6], full2[6])


def test_gap_between_captured_rows_and_start_invalidates() -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    traj.add_turn(prompt_ids=[1, 2, 3], generated_ids=[4, 5], routes=_chunk(4)[1])
    traj.add_turn(prompt_ids=[1, 2, 3, 4, 5, 9], generated_ids=[7], routes=_chunk(1, start=5)[1])
    assert not traj.valid and "gap" in (traj.invalid_reason or "")


def test_retokenized_history_marks_invalid() -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    traj.add_turn(prompt_ids=[1, 2, 3, 4], generated_ids=[5, 6], routes=_chunk(5)[1])
    # the chat template re-tokenized "5 6" as "56": the prompt no longer extends the trajectory token-exactly
    traj.add_turn(prompt_ids=[1, 2, 3, 4, 56, 9], generated_ids=[10], routes=_chunk(6)[1])
    assert not traj.valid
    assert "token-exact" in (traj.invalid_reason or "") and "position 4" in (traj.invalid_reason or "")
    traj.add_turn(prompt_ids=[1, 2, 3, 4, 56, 9, 10], generated_ids=[11], routes=_chunk(7)[1])
    assert not traj.valid  # stays invalid: the sample falls back to native routing


def test_mixed_dtype_boundary_upcasts_before_assignment() -> None:
    # prime-rl #2487/#3051: turn 1 compacts to uint8, turn 2 to uint16; a uint8 store would wrap 300 -> 44.
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    turn1, routes1 = _chunk(4, num_experts=200)
    traj.add_turn(prompt_ids=[1, 2, 3], generated_ids=[4, 5], routes=routes1)
    assert routes1.dtype == "uint8"
    chunk2 = make_routes(3, L, K, 200, seed=9)
    chunk2[0, 1] = [300, 7, 250]  # the boundary row (position 4) routes to expert 300
    routes2 = encode(chunk2, start=4)
    assert routes2.dtype == "uint16"
    traj.add_turn(prompt_ids=[1, 2, 3, 4, 5, 6], generated_ids=[8, 9], routes=routes2)
    out = traj.array()
    assert out.dtype == np.uint16
    assert out[4, 1].tolist() == [300, 7, 250]
    np.testing.assert_array_equal(out[:4], turn1)
    np.testing.assert_array_equal(out[4:], chunk2)


def test_partial_resume_does_not_duplicate_full_sequence_verl_6029() -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    first, routes1 = _chunk(7, seed=1)  # prompt 5 + 3 generated before the rollout was interrupted
    traj.add_turn(prompt_ids=[1, 2, 3, 4, 5], generated_ids=[6, 7, 8], routes=routes1)
    # resumed under new weights: the engine returns the whole sequence (8 prompt + 4 new - 1 = 11 rows)
    resumed = make_routes(11, L, K, E, seed=2)
    traj.add_partial(generated_ids=[9, 10, 11, 12], routes=encode(resumed))
    out = traj.array()
    assert out.shape == (11, L, K)  # not 7 + 11 = 18 (naive concatenation)
    assert traj.tokens == list(range(1, 13))
    np.testing.assert_array_equal(out[:7], first)  # old rows keep the routes of the weights that made them
    np.testing.assert_array_equal(out[7:], resumed[7:])  # only the new tail, incl. the old boundary row 7


def test_partial_resume_with_prompt_start_appends_tail_verl_6046() -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    first, routes1 = _chunk(7, seed=1)
    traj.add_turn(prompt_ids=[1, 2, 3, 4, 5], generated_ids=[6, 7, 8], routes=routes1)
    tail, routes2 = _chunk(4, start=7, seed=3)  # routed_experts_prompt_start=7
    traj.add_partial(generated_ids=[9, 10, 11, 12], routes=routes2)
    np.testing.assert_array_equal(traj.array(), np.concatenate([first, tail]))
    traj.add_partial(generated_ids=[13], routes=_chunk(3, start=7)[1])  # 12 + 1 - 1 - 7 = 5 rows expected
    assert not traj.valid and "expected" in (traj.invalid_reason or "")


def test_layer_mismatch_is_an_error() -> None:
    traj = TrajectoryRoutes(num_layers=L + 1, top_k=K)
    with pytest.raises(RoutingDataError, match="layers"):
        traj.add_turn(prompt_ids=[1, 2], generated_ids=[3], routes=_chunk(2)[1])


def test_missing_routes_invalidate() -> None:
    traj = TrajectoryRoutes(num_layers=L, top_k=K)
    traj.add_turn(prompt_ids=[1, 2], generated_ids=[3], routes=None)
    assert not traj.valid and "no routed experts" in (traj.invalid_reason or "")


# ------------------------------------------------------------------------------------ prefill/decode


def test_disaggregated_routes_are_the_prefill_rows_of_the_prompt_then_the_decode_rows() -> None:
    from r3operator.routing.stitch import stitch_disaggregated

    prompt, generated, start = 7, 5, 2
    whole = make_routes(prompt + generated - 1, L, K, E, seed=3)  # what one engine returns for [0, P + G - 1)
    prefill = encode(whole[start:prompt], start=start)  # a request of one token: rows [start, P)
    decode = encode(whole[prompt - 1 :], start=prompt - 1)  # asked from the prompt's last token on
    stitched, agrees = stitch_disaggregated(prefill, decode, prompt_len=prompt, generated_len=generated)
    assert agrees and stitched.start == start
    np.testing.assert_array_equal(decode_rows(stitched), whole[start:])

    # The decode engine routed the boundary token otherwise: the prefill engine's row is kept, and it is said.
    other = whole[prompt - 1 :].copy()
    other[0] = make_routes(1, L, K, E, seed=99)[0]
    stitched, agrees = stitch_disaggregated(
        prefill, encode(other, start=prompt - 1), prompt_len=prompt, generated_len=generated
    )
    assert not agrees
    np.testing.assert_array_equal(decode_rows(stitched)[prompt - 1 - start], whole[prompt - 1])


def test_disaggregated_parts_that_do_not_cover_their_rows_are_refused() -> None:
    from r3operator.routing.stitch import stitch_disaggregated

    whole = make_routes(10, L, K, E, seed=4)  # prompt 6, generated 5
    prefill, decode = encode(whole[:6]), encode(whole[5:], start=5)
    with pytest.raises(RoutingDataError, match="decode routes start at row 6, expected the prompt's last token 5"):
        stitch_disaggregated(prefill, encode(whole[6:], start=6), prompt_len=6, generated_len=5)
    with pytest.raises(RoutingDataError, match="expected"):  # a prefill answer one row short (off by one)
        stitch_disaggregated(encode(whole[:5]), decode, prompt_len=6, generated_len=5)
    with pytest.raises(RoutingDataError, match="expected"):
        stitch_disaggregated(prefill, decode, prompt_len=6, generated_len=4)


def test_disaggregated_stitch_widens_instead_of_wrapping_ids() -> None:
    from r3operator.routing.stitch import stitch_disaggregated

    low = make_routes(6, L, K, 200, seed=5)  # fits uint8
    high = make_routes(3, L, K, 300, seed=6) + 0  # ids past 255: uint16
    high[-1, 0, 0] = 299
    prefill = encode(low)
    assert prefill.dtype == "uint8"
    boundary_and_tail = np.concatenate([low[-1:], high[1:]])
    stitched, _ = stitch_disaggregated(prefill, encode(boundary_and_tail, start=5), prompt_len=6, generated_len=3)
    assert stitched.dtype == "uint16" and int(decode_rows(stitched).max()) == 299


def decode_rows(routes: RoutedExperts) -> np.ndarray:
    from r3operator.routing import decode

    return decode(routes)
