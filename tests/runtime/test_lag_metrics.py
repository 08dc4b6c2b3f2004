"""The |Δlogprob| split by staleness lag as Prometheus series: bounded lag labels, pooled token-weighted above
the bound, and no series (never NaN) for a lag without tokens."""

from __future__ import annotations

import pytest

from r3operator.rollout.partial import LagGap
from r3operator.runtime.metrics import RuntimeMetrics


def _by_label(exposition: str, name: str) -> dict[str, float]:
    shown = {}
    for line in exposition.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            shown[labels.split('lag="', 1)[1].split('"', 1)[0]] = float(value)
    return shown


def test_lags_from_the_bound_on_are_pooled_token_weighted_under_one_label() -> None:
    """maxStaleness 2: labels "0", "1", ">=2". Lags 2, 3, 4 with 3, 1, 0 tokens and means 0.5, 0.9, -:
    ">=2" holds 3 + 1 = 4 tokens of mean (3 * 0.5 + 1 * 0.9) / 4 = 0.6."""
    metrics = RuntimeMetrics("j", namespace="ns")
    gaps = [LagGap(0, 10, 0.004), LagGap(1, 0, None), LagGap(2, 3, 0.5), LagGap(3, 1, 0.9), LagGap(4, 0, None)]
    metrics.observe_lags(gaps, max_staleness=2)
    text = metrics.exposition()
    assert _by_label(text, "r3operator_response_tokens_by_lag") == {"0": 10, "1": 0, ">=2": 4}
    means = _by_label(text, "r3operator_logprob_abs_diff_mean_by_lag")
    assert means.keys() == {"0", ">=2"}  # lag 1 had no token: no series, not NaN
    assert means["0"] == pytest.approx(0.004) and means[">=2"] == pytest.approx(0.6)


def test_a_lag_that_loses_its_tokens_loses_its_series_and_labels_stay_bounded() -> None:
    metrics = RuntimeMetrics("j", namespace="ns")
    metrics.observe_lags([LagGap(0, 5, 0.01), LagGap(1, 7, 0.2)], max_staleness=1)
    assert _by_label(metrics.exposition(), "r3operator_logprob_abs_diff_mean_by_lag").keys() == {"0", ">=1"}
    metrics.observe_lags([LagGap(0, 0, None), LagGap(1, 7, 0.3)], max_staleness=1)  # the next step: no lag-0 token
    text = metrics.exposition()
    assert _by_label(text, "r3operator_logprob_abs_diff_mean_by_lag") == {">=1": pytest.approx(0.3)}
    assert _by_label(text, "r3operator_response_tokens_by_lag") == {"0": 0, ">=1": 7}

    wide = RuntimeMetrics("k", namespace="ns")  # maxStaleness up to 1000: still 8 exact labels and ">=8"
    wide.observe_lags([LagGap(lag, 1, 0.1 * lag) for lag in range(1001)], max_staleness=1000)
    tokens = _by_label(wide.exposition(), "r3operator_response_tokens_by_lag")
    assert list(tokens) == [*map(str, range(8)), ">=8"] and tokens[">=8"] == 1001 - 8
    means = _by_label(wide.exposition(), "r3operator_logprob_abs_diff_mean_by_lag")
    assert means[">=8"] == pytest.approx(sum(0.1 * lag for lag in range(8, 1001)) / (1001 - 8))
