"""routing/agreement.py compares two routings as expert sets per (token, layer). Tensors off the host are compared on
their device (only the [..., L] answer crosses); the torch comparison runs here on CPU tensors and must give a case
worked out by hand and the numpy comparison's answer (the gpu-accept row `route_checks_cost` compares the two on a
GPU)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3operator.routing import agreement
from r3operator.routing.agreement import routing_agreement

torch = pytest.importorskip("torch")

ENGINE = [[[0, 0], [2, 3]], [[0, 0], [6, 7]], [[0, 0], [1, 4]]]  # [tokens=3, L=2, K=2]; layer 0 dense (vLLM's zeros)
TRAINER = [[[5, 1], [3, 2]], [[0, 0], [6, 1]], [[2, 2], [4, 1]]]  # layer 1: the order alone differs, but for token 1


def test_the_torch_comparison_gives_the_hand_worked_answer() -> None:
    """The comparison a GPU's tensors take, run here on CPU tensors: per (token, layer), equal sets and routed rows."""
    equal, routed = agreement._compared_in_torch(torch.tensor(TRAINER), torch.tensor(ENGINE))
    np.testing.assert_array_equal(equal, [[False, True], [True, False], [False, True]])
    np.testing.assert_array_equal(routed, [[False, True], [False, True], [False, True]])


def test_the_hand_worked_figures() -> None:
    a = routing_agreement(np.array(TRAINER), np.array(ENGINE))
    assert math.isnan(a.per_layer[0]) and a.per_layer[1] == pytest.approx(2 / 3)
    assert a.token_layers == 3 and a.tokens_any_diff_ratio == pytest.approx(1 / 3)
    masked = routing_agreement(np.array(TRAINER), np.array(ENGINE), mask=np.array([True, False, True]))
    assert masked.agreement_ratio == 1.0 and masked.token_layers == 2


def test_the_torch_and_numpy_comparisons_agree_on_a_step_shaped_batch() -> None:
    rng = np.random.default_rng(7)
    b, s, layers, k, experts = 6, 20, 5, 4, 16
    engine = np.argsort(rng.random((b, s, layers, experts)), axis=-1)[..., :k]
    engine[:, :, 0] = 0  # a dense first layer
    trainer = engine.copy()
    redraw = rng.random((b, s, layers)) < 0.3
    trainer[redraw] = np.argsort(rng.random((int(redraw.sum()), experts)), axis=-1)[:, :k]
    trainer = np.take_along_axis(trainer, np.argsort(rng.random(trainer.shape), axis=-1), axis=-1)  # shuffled order
    equal, routed = agreement._compared_sets(trainer, engine)  # numpy
    t_equal, t_routed = agreement._compared_in_torch(
        torch.from_numpy(trainer).to(torch.int32), torch.from_numpy(engine)
    )
    np.testing.assert_array_equal(t_equal, equal)
    np.testing.assert_array_equal(t_routed, routed)
    assert 0 < equal[..., 1:].mean() < 1  # the batch has both: the comparison is not vacuous


def test_tensors_on_the_host_are_compared_in_numpy_with_the_same_figures() -> None:
    want = routing_agreement(np.array(TRAINER), np.array(ENGINE))
    got = routing_agreement(torch.tensor(TRAINER), torch.tensor(ENGINE))
    assert (got.token_layers, got.agreement_ratio, got.tokens_any_diff_ratio) == (
        want.token_layers,
        want.agreement_ratio,
        want.tokens_any_diff_ratio,
    )
    np.testing.assert_equal(got.per_layer, want.per_layer)  # the dense layer's nan on both sides


def test_tensors_of_different_shapes_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"got \(2, 3, 2\) and \(2, 4, 2\)"):
        agreement._compared_in_torch(torch.zeros(2, 3, 2), torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match=r"got \(2, 3, 2\) and \(2, 4, 2\)"):
        routing_agreement(torch.zeros(2, 3, 2), torch.zeros(2, 4, 2))
