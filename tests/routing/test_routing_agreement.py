"""routing/agreement.py compares two routings as expert sets per (token, layer). Torch tensors are compared where they
are (only the [..., L] answer crosses to the host); the figures must be those of the numpy comparison and of a case
worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3operator.routing.agreement import routing_agreement

torch = pytest.importorskip("torch")


def test_tensors_give_the_hand_worked_figures() -> None:
    engine = torch.tensor([[[0, 0], [2, 3]], [[0, 0], [6, 7]], [[0, 0], [1, 4]]])  # layer 0 dense (vLLM's zeros)
    trainer = torch.tensor([[[5, 1], [3, 2]], [[0, 0], [6, 1]], [[2, 2], [4, 1]]])  # order alone differs: equal sets
    a = routing_agreement(trainer, engine)
    assert math.isnan(a.per_layer[0]) and a.per_layer[1] == pytest.approx(2 / 3)
    assert a.token_layers == 3 and a.tokens_any_diff_ratio == pytest.approx(1 / 3)
    masked = routing_agreement(trainer, engine, mask=torch.tensor([True, False, True]))
    assert masked.agreement_ratio == 1.0 and masked.token_layers == 2


def test_tensors_and_arrays_agree_on_a_step_shaped_batch() -> None:
    rng = np.random.default_rng(7)
    b, s, layers, k, experts = 6, 20, 5, 4, 16
    engine = np.argsort(rng.random((b, s, layers, experts)), axis=-1)[..., :k]
    engine[:, :, 0] = 0  # a dense first layer
    trainer = engine.copy()
    redraw = rng.random((b, s, layers)) < 0.3
    trainer[redraw] = np.argsort(rng.random((int(redraw.sum()), experts)), axis=-1)[:, :k]
    trainer = np.take_along_axis(trainer, np.argsort(rng.random(trainer.shape), axis=-1), axis=-1)  # shuffled order
    mask = rng.random((b, s)) < 0.8
    want = routing_agreement(trainer, engine, mask)
    got = routing_agreement(torch.from_numpy(trainer).to(torch.int32), torch.from_numpy(engine), torch.from_numpy(mask))
    assert (got.token_layers, got.agreement_ratio, got.tokens_any_diff_ratio) == (
        want.token_layers,
        want.agreement_ratio,
        want.tokens_any_diff_ratio,
    )
    np.testing.assert_equal(got.per_layer, want.per_layer)  # the dense layer's nan on both sides
    assert 0.0 < want.agreement_ratio < 1.0  # the batch has both: the comparison is not vacuous


def test_tensors_of_different_shapes_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"got \(2, 3, 2\) and \(2, 4, 2\)"):
        routing_agreement(torch.zeros(2, 3, 2), torch.zeros(2, 4, 2))
