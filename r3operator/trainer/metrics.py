"""Rollout-vs-trainer fidelity and routing metrics, plus their Prometheus exporter.

Pure functions take torch tensors or NumPy arrays (converted once) and never loop over tokens.
All logprob statistics are over response tokens selected by a boolean mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from r3operator.routing.agreement import RoutingAgreement, as_array, routing_agreement
from r3operator.routing.sample import RolloutSample

EXTREME_RATIO_TAU = 2.0


_np = as_array
__all__ = ["EXTREME_RATIO_TAU", "RoutingAgreement", "logprob_stats", "routing_agreement"]


@dataclass(frozen=True)
class LogprobStats:
    tokens: int
    abs_diff_mean: float
    abs_diff_std: float
    abs_diff_max: float
    abs_diff_min: float
    kl_k3: float
    extreme_token_fraction: float


def logprob_stats(
    rollout_logprobs: Any, trainer_logprobs: Any, mask: Any | None = None, *, tau: float = EXTREME_RATIO_TAU
) -> LogprobStats:
    """|rollout - trainer| mean/std/max/min, k3 KL(pi_rollout || pi_train) and F(tau) over masked tokens.

    k3 (Schulman's estimator, samples drawn from pi_rollout): with r = p_train / p_rollout,
    k3 = (r - 1) - log r, averaged over tokens; unbiased for KL(pi_rollout || pi_train) and >= 0.
    F(tau) is the fraction of tokens with max(r, 1/r) > tau, i.e. |log r| > log tau.
    """
    roll = _np(rollout_logprobs, np.float64)
    train = _np(trainer_logprobs, np.float64)
    if roll.shape != train.shape:
        raise ValueError(f"rollout logprobs {roll.shape} and trainer logprobs {train.shape} differ in shape")
    sel = np.ones(roll.shape, dtype=bool) if mask is None else _np(mask).astype(bool)
    if sel.shape != roll.shape:
        raise ValueError(f"mask {sel.shape} does not match logprobs {roll.shape}")
    log_ratio = (train - roll)[sel]
    if log_ratio.size == 0:
        nan = float("nan")
        return LogprobStats(0, nan, nan, nan, nan, nan, nan)
    absd = np.abs(log_ratio)
    k3 = np.expm1(log_ratio) - log_ratio
    return LogprobStats(
        tokens=int(log_ratio.size),
        abs_diff_mean=float(absd.mean()),
        abs_diff_std=float(absd.std()),
        abs_diff_max=float(absd.max()),
        abs_diff_min=float(absd.min()),
        kl_k3=float(k3.mean()),
        extreme_token_fraction=float((absd > np.log(tau)).mean()),
    )


# --- Prometheus ------------------------------------------------------------------------------------------

MetricType = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str


# One prefix for every series we export (`r3operator_`), `namespace` and `rljob` on each: `job` would
# collide with Prometheus' own target label and be stored as `exported_job`.
IDENTITY_LABELS = ("namespace", "rljob")
_ID = IDENTITY_LABELS

METRICS: list[MetricSpec] = [
    MetricSpec(
        "r3operator_logprob_abs_diff_mean",
        "gauge",
        _ID,
        "Mean |rollout - trainer| sampled-token logprob over response tokens, last step (async: only tokens "
        "of the current policy version in trajectories no weight update interrupted, so it measures the "
        "mismatch, not the staleness nor a resumed trajectory's context).",
    ),
    MetricSpec(
        "r3operator_logprob_abs_diff_std",
        "gauge",
        _ID,
        "Std of |rollout - trainer| logprob over response tokens, last step.",
    ),
    MetricSpec(
        "r3operator_logprob_abs_diff_max",
        "gauge",
        _ID,
        "Max |rollout - trainer| logprob over response tokens, last step.",
    ),
    MetricSpec(
        "r3operator_logprob_abs_diff_min",
        "gauge",
        _ID,
        "Min |rollout - trainer| logprob over response tokens, last step.",
    ),
    MetricSpec(
        "r3operator_kl_k3", "gauge", _ID, "k3 estimate of KL(pi_rollout || pi_train) per response token, last step."
    ),
    MetricSpec(
        "r3operator_extreme_token_ratio",
        "gauge",
        _ID,
        "Fraction of response tokens with max(p_train/p_roll, p_roll/p_train) > 2, last step.",
    ),
    MetricSpec(
        "r3operator_routing_agreement_ratio",
        "gauge",
        (*_ID, "layer"),
        "Alignment health: tokens whose trainer router's own top-k expert set equals the engine's routes, "
        "per MoE layer, last step (about 0.98 aligned; near 0 when routes land on the wrong tokens; async: "
        "rows of the current policy version in trajectories no weight update interrupted).",
    ),
    MetricSpec(
        "r3operator_routing_tokens_any_diff_ratio",
        "gauge",
        _ID,
        "Tokens whose natural trainer routing differs from the engine's in at least one MoE layer.",
    ),
    MetricSpec(
        "r3operator_routing_bytes_total", "counter", _ID, "Bytes of routed-expert payload received from the engine."
    ),
    MetricSpec(
        "r3operator_routes_missing_total",
        "counter",
        _ID,
        "Samples that came back without routed experts (capture off, aborted request).",
    ),
    MetricSpec(
        "r3operator_routes_invalid_total",
        "counter",
        _ID,
        "Samples whose routed experts failed validation (row count, id range, duplicates).",
    ),
    MetricSpec(
        "r3operator_replay_active",
        "gauge",
        _ID,
        "1 while the job replays rollout routes (routingReplay.mode R3), else 0 (R2, Disabled).",
    ),
    MetricSpec(
        "r3operator_routes_per_sample_bytes", "histogram", _ID, "Routed-expert payload bytes per sample with routes."
    ),
]

_BYTES_BUCKETS = tuple(float(4**i) for i in range(4, 14))  # 256 B .. 64 MiB


def disable_created_series() -> None:
    """Stop prometheus_client from exporting a `*_created` series per counter and histogram: they double
    the series count and nothing here reads them (process-wide, as the library's switch is)."""
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]


class R3Metrics:
    """Holds the METRICS collectors on a registry (a fresh one unless given), every series labelled with
    the RLJob's `namespace` and `rljob`."""

    def __init__(self, rljob: str, registry: Any = None, *, namespace: str = "default") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        disable_created_series()
        self.rljob, self.namespace = rljob, namespace
        self.registry = registry if registry is not None else CollectorRegistry()
        kinds = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}
        self._m: dict[str, Any] = {}
        self._layers_exported: set[str] = set()
        for spec in METRICS:
            kwargs: dict[str, Any] = {"registry": self.registry}
            if spec.type == "histogram":
                kwargs["buckets"] = _BYTES_BUCKETS
            # prometheus_client appends `_total` to counters itself: register the base name.
            base = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
            self._m[spec.name] = kinds[spec.type](base, spec.help, list(spec.labels), **kwargs)
            if spec.labels == IDENTITY_LABELS and spec.type != "gauge":
                # Create the job's counters and histograms now, so they read 0 (not "no data") until the first
                # event and rate()/increase() see the start of the run. A gauge is a figure measured: it has no
                # series until it is (a KL of 0 before step 1 would read as a perfect engine).
                self._get(spec.name)

    def _get(self, name: str, **labels: str) -> Any:
        return self._m[name].labels(namespace=self.namespace, rljob=self.rljob, **labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        """One of METRICS' gauges set to a figure measured before (a finished run's, observability/backfill.py)."""
        self._get(name, **labels).set(value)

    def observe_logprobs(self, rollout_logprobs: Any, trainer_logprobs: Any, mask: Any | None = None) -> LogprobStats:
        stats = logprob_stats(rollout_logprobs, trainer_logprobs, mask)
        for field in ("abs_diff_mean", "abs_diff_std", "abs_diff_max", "abs_diff_min"):
            self._get(f"r3operator_logprob_{field}").set(getattr(stats, field))
        self._get("r3operator_kl_k3").set(stats.kl_k3)
        self._get("r3operator_extreme_token_ratio").set(stats.extreme_token_fraction)
        return stats

    def observe_routing(self, trainer_ids: Any, engine_ids: Any, mask: Any | None = None) -> RoutingAgreement:
        """Export the natural agreement of the trainer's routers with the engine's routes per MoE layer.

        `trainer_ids` must be what the routers choose by themselves (under R3: recorded inside the replayed
        forward), never the ids the replay hook handed the experts: those equal the engine's by
        construction and would read 1.0 even with every route on the wrong token.
        """
        agreement = routing_agreement(trainer_ids, engine_ids, mask)
        for layer, ratio in enumerate(agreement.per_layer):
            if not np.isnan(ratio):  # dense layers have no routing to agree on
                self._get("r3operator_routing_agreement_ratio", layer=str(layer)).set(ratio)
                self._layers_exported.add(str(layer))
        self._get("r3operator_routing_tokens_any_diff_ratio").set(agreement.tokens_any_diff_ratio)
        return agreement

    def clear_fidelity(self, *, routing_only: bool = False) -> None:
        """Remove the job's engine/trainer fidelity series (what `observe_logprobs` and `observe_routing`
        set) for a step that had no token to measure them on: no series reads "not measured" on a dashboard
        and in an alert, where NaN would be a sample that blinds avg_over_time() for its whole window."""
        names = ["r3operator_routing_tokens_any_diff_ratio"]
        if not routing_only:
            names += [
                f"r3operator_logprob_{field}"
                for field in ("abs_diff_mean", "abs_diff_std", "abs_diff_max", "abs_diff_min")
            ]
            names += ["r3operator_kl_k3", "r3operator_extreme_token_ratio"]
        for name in names:
            self._m[name].remove(self.namespace, self.rljob)
        for layer in self._layers_exported:
            self._m["r3operator_routing_agreement_ratio"].remove(self.namespace, self.rljob, layer)
        self._layers_exported.clear()

    def observe_rollout(self, samples: Sequence[RolloutSample]) -> None:
        """Count route bytes, missing and invalid routes of `RolloutSample`s."""
        for sample in samples:  # per sample, not per token
            if sample.routes is not None:  # routes_status "ok"
                self._get("r3operator_routing_bytes_total").inc(sample.routes.nbytes)
                self._get("r3operator_routes_per_sample_bytes").observe(sample.routes.nbytes)
            elif sample.routes_status == "missing":
                self._get("r3operator_routes_missing_total").inc()
            else:
                self._get("r3operator_routes_invalid_total").inc()

    def set_replay_active(self, active: bool) -> None:
        self._get("r3operator_replay_active").set(1.0 if active else 0.0)
