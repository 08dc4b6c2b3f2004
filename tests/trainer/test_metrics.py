"""Fidelity / routing metrics and the Prometheus exporter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from r3operator.trainer.metrics import METRICS, R3Metrics, logprob_stats, routing_agreement


def test_logprob_stats_over_masked_tokens() -> None:
    roll = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]])
    train = np.array([[-1.1, -2.0, -3.0 + math.log(3)], [-0.5, -0.3, 0.0]])
    mask = np.array([[True, True, True], [True, True, False]])  # last token is padding: ignored
    s = logprob_stats(roll, train, mask)
    diffs = np.array([0.1, 0.0, math.log(3), 0.0, 0.2])
    assert s.tokens == 5
    assert s.abs_diff_mean == pytest.approx(diffs.mean())
    assert s.abs_diff_std == pytest.approx(diffs.std())
    assert s.abs_diff_max == pytest.approx(math.log(3)) and s.abs_diff_min == 0.0
    log_r = np.array([-0.1, 0.0, math.log(3), 0.0, -0.2])
    assert s.kl_k3 == pytest.approx(np.mean(np.exp(log_r) - 1 - log_r))
    assert s.extreme_token_fraction == pytest.approx(1 / 5)  # only the ratio-3 token exceeds tau=2


def test_k3_is_an_unbiased_kl_estimate() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(20))
    q = p * np.exp(rng.normal(0, 0.3, 20))
    q /= q.sum()
    draws = rng.choice(20, size=200_000, p=p)
    s = logprob_stats(np.log(p[draws]), np.log(q[draws]))
    assert s.kl_k3 == pytest.approx(float(np.sum(p * np.log(p / q))), rel=0.05)


def test_logprob_stats_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        logprob_stats(np.zeros(3), np.zeros(4))


def test_routing_agreement_compares_sets_per_layer() -> None:
    engine = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 2], [3, 4]]])  # [tokens=3, L=2, K=2]
    trainer = np.array([[[1, 0], [2, 3]], [[4, 5], [6, 0]], [[1, 2], [4, 3]]])  # order differs only
    a = routing_agreement(trainer, engine)
    assert a.token_layers == 6
    assert a.agreement_ratio == pytest.approx(5 / 6)
    assert a.tokens_any_diff_ratio == pytest.approx(1 / 3)
    assert a.per_layer == (1.0, pytest.approx(2 / 3))
    masked = routing_agreement(trainer, engine, mask=np.array([True, False, True]))
    assert masked.agreement_ratio == 1.0


def test_dense_layers_stay_out_of_the_agreement() -> None:
    engine = np.array([[[0, 0], [2, 3]], [[0, 0], [6, 7]]])  # layer 0 dense: vLLM's zero rows
    trainer = np.array([[[0, 0], [2, 3]], [[0, 0], [6, 1]]])
    a = routing_agreement(trainer, engine)
    assert math.isnan(a.per_layer[0]) and a.per_layer[1] == 0.5
    assert a.token_layers == 2 and a.agreement_ratio == 0.5 and a.tokens_any_diff_ratio == 0.5


def test_exporter_registers_every_documented_metric() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    metrics = R3Metrics("job-a", registry)
    metrics.observe_logprobs(np.array([-1.0, -2.0]), np.array([-1.5, -2.0]))
    routes = np.array([[[0, 0], [1, 2], [3, 4]], [[0, 0], [5, 6], [1, 7]]])  # [tokens, L=3, K=2], layer 0 dense
    metrics.observe_routing(routes, routes)
    metrics.set_replay_active(True)
    text = generate_latest(registry).decode()
    for spec in METRICS:
        assert spec.name.startswith("r3operator_") and spec.help
        assert f"# HELP {spec.name} " in text, spec.name
    assert 'r3operator_logprob_abs_diff_mean{namespace="default",rljob="job-a"} 0.25' in text
    assert 'r3operator_routing_agreement_ratio{layer="2",namespace="default",rljob="job-a"} 1.0' in text
    assert 'layer="0"' not in text  # a dense layer has no routing to agree on
    assert 'r3operator_replay_active{namespace="default",rljob="job-a"} 1.0' in text


def test_job_series_exist_from_the_start_so_counters_read_zero_not_no_data():
    from prometheus_client import generate_latest

    from r3operator.trainer.metrics import R3Metrics

    text = generate_latest(R3Metrics("job-b").registry).decode()
    assert 'r3operator_routes_missing_total{namespace="default",rljob="job-b"} 0.0' in text
    assert 'r3operator_routes_invalid_total{namespace="default",rljob="job-b"} 0.0' in text


def test_measured_gauges_have_no_series_until_measured():
    """Before step 1 nothing has been compared: a KL or |Δlogprob| of 0 there would read as a perfect engine on a
    dashboard (and a finished run's file played from its start would show it too)."""
    from prometheus_client import generate_latest

    metrics = R3Metrics("job-c")
    before = generate_latest(metrics.registry).decode()
    for name in ("r3operator_kl_k3", "r3operator_logprob_abs_diff_mean", "r3operator_extreme_token_ratio",
                 "r3operator_routing_tokens_any_diff_ratio", "r3operator_replay_active"):  # fmt: skip
        assert f"\n{name}{{" not in before, name
    metrics.observe_logprobs(np.array([-1.0, -2.0]), np.array([-1.0, -2.5]))
    after = generate_latest(metrics.registry).decode()
    line = next(ln for ln in after.splitlines() if ln.startswith('r3operator_kl_k3{namespace="default",rljob="job-c"}'))
    # k3 of one token at log ratio r = -0.5 and one at 0: mean of (e^r - 1 - r) over the two
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx((math.exp(-0.5) - 1 + 0.5) / 2, rel=1e-12)
