"""Prometheus recording and alerting rules, as code.

Recording rules turn the vLLM engine metrics, whose names changed across vLLM releases, into stable
`r3operator:engine_*` series; the engine dashboard reads only those. Each rule reads the current name
OR the legacy one (`a or b`), so engines on either side of a rename feed the same series.

`r3operator dashboards` writes :func:`rule_groups` to
charts/r3operator/files/rules/r3operator.rules.yaml (the PrometheusRule `spec`, which is also a plain
Prometheus rule file); tests/observability check that the file is current, run `promtool check rules`
and the alert unit tests in tests/observability/rules_test.yaml.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

# Alert thresholds. Why these values: see docs/metrics.md#alerts.
LOGPROB_DIFF_SPIKE_FACTOR = 3.0  # mean |Δlogprob| vs. its own 1 h baseline
LOGPROB_DIFF_FLOOR = 0.05  # below this a "spike" is noise (bf16 rollout-vs-train noise is ~0.01-0.03)
# Mean over MoE layers of the trainer routers' own top-k vs the engine's routes: ~0.98 aligned, ~0.003
# with every route one token off, so 0.8 separates them with margin for bf16 near-ties.
ROUTING_AGREEMENT_MIN = 0.80
NO_PROGRESS_MINUTES = 15
RECONCILE_ERROR_MINUTES = 10

RATE = "1m"  # recording-rule rate window; >= 4 scrape intervals of the default 15 s


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    help: str  # goes to docs/metrics.md, not into the rule file


@dataclass(frozen=True)
class Alert:
    alert: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    labels: dict[str, str] = field(default_factory=dict)

    def as_rule(self) -> dict[str, Any]:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, **self.labels},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def vllm(series: str) -> str:
    """Select a vLLM series under its `vllm:` name or the `vllm_` form Prometheus stores when it scrapes
    prometheus_client over OpenMetrics, whose sample lines turn `:` into `_` (prometheus/client_python
    #1177; tests/observability scrape the fake engines that way and see it)."""
    return f'{{__name__=~"{series}|{series.replace(":", "_")}"}}'


def _by_engine(agg: str, expr: str) -> str:
    # `engine` is vLLM's data-parallel rank inside one server; older releases have no such label.
    return f"{agg} without (engine) ({expr})"


def _current_or_legacy(agg: str, current: str, legacy: str) -> str:
    return f"{_by_engine(agg, current)} or {_by_engine(agg, legacy)}"


def _quantile(q: float, current: str, legacy: str | None = None) -> str:
    buckets = _by_engine("sum", f"rate({current}_bucket[{RATE}])")
    if legacy is not None:
        buckets += f" or {_by_engine('sum', f'rate({legacy}_bucket[{RATE}])')}"
    return f"histogram_quantile({q}, {buckets})"


_READABLE: tuple[Recording, ...] = (
    Recording("r3operator:engine_requests_running", _by_engine("sum", "vllm:num_requests_running"),
              "Requests in model execution batches, per engine pod."),
    Recording("r3operator:engine_requests_waiting", _by_engine("sum", "vllm:num_requests_waiting"),
              "Requests waiting to be scheduled, per engine pod."),
    Recording("r3operator:engine_kv_cache_usage_ratio",
              _current_or_legacy("max", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
              "KV-cache usage (0..1), max over the pod's DP ranks."),
    Recording("r3operator:engine_generation_tokens:rate1m",
              _by_engine("sum", f"rate(vllm:generation_tokens_total[{RATE}])"),
              "Generated tokens per second, per engine pod."),
    Recording("r3operator:engine_prompt_tokens:rate1m",
              _by_engine("sum", f"rate(vllm:prompt_tokens_total[{RATE}])"),
              "Prefill tokens per second, per engine pod."),
    Recording("r3operator:engine_requests_finished:rate1m",
              f"sum without (engine, finished_reason) (rate(vllm:request_success_total[{RATE}]))",
              "Finished requests per second, per engine pod."),
    Recording("r3operator:engine_preemptions:rate1m",
              _by_engine("sum", f"rate(vllm:num_preemptions_total[{RATE}])"),
              "Preemptions per second (KV-cache pressure), per engine pod."),
    Recording("r3operator:engine_prefix_cache_hit_ratio",
              f"({_by_engine('sum', f'rate(vllm:prefix_cache_hits_total[{RATE}])')}"
              f" / {_by_engine('sum', f'rate(vllm:prefix_cache_queries_total[{RATE}])')})"
              f" or ({_by_engine('sum', f'rate(vllm:gpu_prefix_cache_hits_total[{RATE}])')}"
              f" / {_by_engine('sum', f'rate(vllm:gpu_prefix_cache_queries_total[{RATE}])')})",
              "Prefix-cache hit ratio over 1 m (NaN while idle)."),
    Recording("r3operator:engine_e2e_latency_seconds:p50", _quantile(0.5, "vllm:e2e_request_latency_seconds"),
              "Median end-to-end request latency."),
    Recording("r3operator:engine_e2e_latency_seconds:p95", _quantile(0.95, "vllm:e2e_request_latency_seconds"),
              "95th percentile end-to-end request latency."),
    Recording("r3operator:engine_ttft_seconds:p95", _quantile(0.95, "vllm:time_to_first_token_seconds"),
              "95th percentile time to first token."),
    Recording("r3operator:engine_itl_seconds:p95",
              _quantile(0.95, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
              "95th percentile inter-token latency."),
)  # fmt: skip

_VLLM_NAME = re.compile(r"vllm:[a-z0-9_]+")
# What ships: every vLLM name also matches its underscored form (see `vllm`).
RECORDINGS: tuple[Recording, ...] = tuple(
    Recording(r.record, _VLLM_NAME.sub(lambda m: vllm(m.group(0)), r.expr), r.help) for r in _READABLE
)

_JOB = "namespace, rljob"

ALERTS: tuple[Alert, ...] = (
    Alert(
        "R3LogprobDiffSpike",
        f"r3_logprob_abs_diff_mean > {LOGPROB_DIFF_SPIKE_FACTOR}"
        " * avg_over_time(r3_logprob_abs_diff_mean[1h] offset 10m)"
        f" and r3_logprob_abs_diff_mean > {LOGPROB_DIFF_FLOOR}",
        "5m", "warning",
        "Rollout-vs-trainer logprob mismatch spiked for {{ $labels.namespace }}/{{ $labels.rljob }}",
        "Mean |Δlogprob| is {{ $value | printf \"%.3f\" }}, over "
        f"{LOGPROB_DIFF_SPIKE_FACTOR:g}x its 1 h baseline. Check weight sync (r3_weight_sync_canary_ok), the "
        "vLLM version and whether routing replay is active.",
    ),
    Alert(
        "R3RoutingAgreementLow",
        f"avg without (layer) (r3_routing_agreement_ratio) < {ROUTING_AGREEMENT_MIN}"
        f" and on ({_JOB}) (max by ({_JOB}) (r3_replay_active) == 1)",
        "10m", "warning",
        "Routing agreement {{ $value | humanizePercentage }} under R3 for {{ $labels.namespace }}/{{ $labels.rljob }}",
        "The trainer's routers agree with the engine's routes on ~98% of token-layers when the routes sit on the "
        "right tokens. This low, the replayed routes land on the wrong tokens (a misaligned batch) or the "
        "policies drifted (stale weights, a failed weight sync).",
    ),
    Alert(
        "R3RoutesMissing",
        f"sum by ({_JOB}) (increase(r3_routes_missing_total[10m])) > 0"
        f" and on ({_JOB}) (max by ({_JOB}) (r3_replay_active) == 1)",
        "0m", "warning",
        "Samples without routed experts under R3 in {{ $labels.namespace }}/{{ $labels.rljob }}",
        "{{ $value | printf \"%.0f\" }} samples in 10 m came back without routes; they train without replay. "
        "Check the engine's routed-experts capture and aborted requests.",
    ),
    Alert(
        "R3RoutesInvalid",
        f"sum by ({_JOB}) (increase(r3_routes_invalid_total[10m])) > 0",
        "0m", "critical",
        "Invalid routed experts in {{ $labels.namespace }}/{{ $labels.rljob }}",
        "{{ $value | printf \"%.0f\" }} samples in 10 m had routes that failed validation (row count, id range, "
        "duplicates): the engine and trainer disagree on the model layout.",
    ),
    Alert(
        "RLJobNoProgress",
        f"changes(r3operator_rljob_step[{NO_PROGRESS_MINUTES}m]) == 0"
        f" and on ({_JOB}) (r3operator_rljob_condition{{type=\"Ready\",status=\"True\"}} == 1)",
        "0m", "warning",
        f"RLJob {{{{ $labels.namespace }}}}/{{{{ $labels.rljob }}}} made no step in {NO_PROGRESS_MINUTES} m",
        "The job is Ready but status.step has not moved. Look at the trainer logs and r3_step_phase_seconds.",
    ),
    Alert(
        "RLJobUpgradeBlocked",
        f"max by ({_JOB}) (r3operator_rljob_condition{{type=\"UpgradeBlocked\",status=\"True\"}}) == 1",
        "0m", "warning",
        "Engine upgrade of {{ $labels.namespace }}/{{ $labels.rljob }} blocked by its fidelity canary",
        "The new engine image failed the canary and the engines are back on the old one; spec.inference.image "
        "still names the new image. `kubectl describe rlj` shows the figures (condition UpgradeBlocked).",
    ),
    Alert(
        "R3OperatorReconcileErrors",
        "sum by (reason) (rate(r3operator_reconcile_errors_total[5m])) > 0",
        f"{RECONCILE_ERROR_MINUTES}m", "warning",
        "r3operator reconcile errors ({{ $labels.reason }})",
        f"Reconciles have failed for {RECONCILE_ERROR_MINUTES} m at {{{{ $value | printf \"%.2f\" }}}}/s "
        "(reason {{ $labels.reason }}). See the operator logs and RLJob events.",
    ),
)


def rule_groups() -> dict[str, Any]:
    return {
        "groups": [
            {"name": "r3operator-engine.rules", "rules": [{"record": r.record, "expr": r.expr} for r in RECORDINGS]},
            {"name": "r3operator.alerts", "rules": [a.as_rule() for a in ALERTS]},
        ]
    }


def render_rules_yaml() -> str:
    header = "# Generated by `r3operator dashboards` from rules.py. Do not edit.\n"
    return header + yaml.safe_dump(rule_groups(), sort_keys=False, width=1000)


def recorded_series() -> set[str]:
    return {r.record for r in RECORDINGS}


def all_exprs() -> dict[str, str]:
    """Rule name -> PromQL, for the parse and contract checks."""
    return {**{r.record: r.expr for r in RECORDINGS}, **{a.alert: a.expr for a in ALERTS}}
