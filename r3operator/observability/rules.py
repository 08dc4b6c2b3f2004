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

# ReplayHealthy's thresholds: the condition (operator/replay_health.py) and R3ReplayUnhealthy say the same.
from r3operator.operator.replay_health import (
    EXTREME_TOKEN_FRACTION_MAX,
    FALLBACK_FRACTION_MAX,
    REPLAYED_FRACTION_MIN,
)

# Alert thresholds. Why these values: see docs/metrics.md#alerts.
LOGPROB_DIFF_SPIKE_FACTOR = 3.0  # mean |Δlogprob| vs. its own 1 h baseline
LOGPROB_DIFF_FLOOR = 0.05  # below this a "spike" is noise (bf16 rollout-vs-train noise is ~0.01-0.03)
# Mean over MoE layers of the trainer routers' own top-k vs the engine's routes: ~0.98 aligned, ~0.003
# with every route one token off, so 0.8 separates them with margin for bf16 near-ties.
ROUTING_AGREEMENT_MIN = 0.80
NO_PROGRESS_FOR = "5m"  # the per-job threshold (spec.monitoring.noProgressSeconds) must be exceeded this long
RECONCILE_ERROR_MINUTES = 10

# The PodMonitor scrapes every 30 s; a rate window needs >= 4 samples to survive one missed scrape.
SCRAPE_INTERVAL_SECONDS = 30
RATE = "2m"
RATE_SUFFIX = f"rate{RATE}"

# Alerts link their runbook section in docs/metrics.md; the chart swaps this base for
# `prometheusRule.runbookBaseURL` (a fork or an internal mirror).
RUNBOOK_BASE = "https://github.com/r3operator/r3operator/blob/main/docs/metrics.md"


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
    runbook: str  # markdown: what to check first; docs/metrics.md renders it under `### <alert>`
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def anchor(self) -> str:
        """The GitHub anchor of the alert's `### <alert>` heading in docs/metrics.md."""
        return self.alert.lower()

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_BASE}#{self.anchor}"

    def as_rule(self) -> dict[str, Any]:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, **self.labels},
            "annotations": {"summary": self.summary, "description": self.description, "runbook_url": self.runbook_url},
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
    Recording(
        "r3operator:engine_requests_running",
        _by_engine("sum", "vllm:num_requests_running"),
        "Requests in model execution batches, per engine pod.",
    ),
    Recording(
        "r3operator:engine_requests_waiting",
        _by_engine("sum", "vllm:num_requests_waiting"),
        "Requests waiting to be scheduled, per engine pod.",
    ),
    Recording(
        "r3operator:engine_kv_cache_usage_ratio",
        _current_or_legacy("max", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "KV-cache usage (0..1), max over the pod's DP ranks.",
    ),
    Recording(
        "r3operator:engine_generation_tokens:" + RATE_SUFFIX,
        _by_engine("sum", f"rate(vllm:generation_tokens_total[{RATE}])"),
        "Generated tokens per second, per engine pod.",
    ),
    Recording(
        "r3operator:engine_prompt_tokens:" + RATE_SUFFIX,
        _by_engine("sum", f"rate(vllm:prompt_tokens_total[{RATE}])"),
        "Prefill tokens per second, per engine pod.",
    ),
    Recording(
        "r3operator:engine_requests_finished:" + RATE_SUFFIX,
        f"sum without (engine, finished_reason) (rate(vllm:request_success_total[{RATE}]))",
        "Finished requests per second, per engine pod.",
    ),
    Recording(
        "r3operator:engine_preemptions:" + RATE_SUFFIX,
        _by_engine("sum", f"rate(vllm:num_preemptions_total[{RATE}])"),
        "Preemptions per second (KV-cache pressure), per engine pod.",
    ),
    Recording(
        "r3operator:engine_prefix_cache_hit_ratio",
        f"({_by_engine('sum', f'rate(vllm:prefix_cache_hits_total[{RATE}])')}"
        f" / {_by_engine('sum', f'rate(vllm:prefix_cache_queries_total[{RATE}])')})"
        f" or ({_by_engine('sum', f'rate(vllm:gpu_prefix_cache_hits_total[{RATE}])')}"
        f" / {_by_engine('sum', f'rate(vllm:gpu_prefix_cache_queries_total[{RATE}])')})",
        f"Prefix-cache hit ratio over {RATE} (NaN while idle).",
    ),
    Recording(
        "r3operator:engine_e2e_latency_seconds:p50",
        _quantile(0.5, "vllm:e2e_request_latency_seconds"),
        "Median end-to-end request latency.",
    ),
    Recording(
        "r3operator:engine_e2e_latency_seconds:p95",
        _quantile(0.95, "vllm:e2e_request_latency_seconds"),
        "95th percentile end-to-end request latency.",
    ),
    Recording(
        "r3operator:engine_ttft_seconds:p95",
        _quantile(0.95, "vllm:time_to_first_token_seconds"),
        "95th percentile time to first token.",
    ),
    Recording(
        "r3operator:engine_itl_seconds:p95",
        _quantile(0.95, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "95th percentile inter-token latency.",
    ),
)

_VLLM_NAME = re.compile(r"vllm:[a-z0-9_]+")
# What ships: every vLLM name also matches its underscored form (see `vllm`).
RECORDINGS: tuple[Recording, ...] = tuple(
    Recording(r.record, _VLLM_NAME.sub(lambda m: vllm(m.group(0)), r.expr), r.help) for r in _READABLE
)

_JOB = "namespace, rljob"

ALERTS: tuple[Alert, ...] = (
    Alert(
        "R3LogprobDiffSpike",
        f"r3operator_logprob_abs_diff_mean > {LOGPROB_DIFF_SPIKE_FACTOR}"
        " * avg_over_time(r3operator_logprob_abs_diff_mean[1h] offset 10m)"
        f" and r3operator_logprob_abs_diff_mean > {LOGPROB_DIFF_FLOOR}",
        "5m",
        "warning",
        "Rollout-vs-trainer logprob mismatch spiked for {{ $labels.namespace }}/{{ $labels.rljob }}",
        'Mean |Δlogprob| is {{ $value | printf "%.3f" }}, over '
        f"{LOGPROB_DIFF_SPIKE_FACTOR:g}x its 1 h baseline. Check weight sync (r3operator_weight_sync_canary_ok), the "
        "vLLM version and whether routing replay is active.",
        "The engine and the trainer disagree on the sampled tokens' logprobs far more than their own recent "
        "baseline, under the same weights: in algorithm.mode async the figure covers only tokens of the policy "
        "version the step trained from, in trajectories that version sampled alone (fresh ones), and a step "
        "without any leaves the series out (not NaN). The older tokens' gap is staleness "
        '(`r3operator_logprob_abs_diff_mean_by_lag{lag!="0"}`, `logprob_abs_diff_by_lag` in metrics.csv; '
        "corrected by the importance weights, never a weight-sync fault). The current-version tokens of "
        "resumed trajectories (`rollout.partialRollout`) are left out too: the engine sampled them after "
        "re-reading the earlier tokens under the new weights while the trainer replays those tokens' old "
        'routes, a gap that is no mismatch (`logprob_abs_diff_mean_resumed` in metrics.csv; lag="0" of the '
        "split counts them). In order: (1) "
        "`r3operator_weight_sync_canary_ok` is 0 or the driver log shows weight-sync "
        "faults: the engines serve stale weights; (2) `r3operator_replay_active` is 0 on an MoE model: routing "
        "replay is off, so router flips show up here; (3) the engine image's vLLM differs from the pinned "
        "`spec.inference.vllmVersion` (kernels changed numerics). `kubectl get rljob <job> -o "
        "jsonpath='{.status.resolved}'` shows the resolved version.",
    ),
    Alert(
        "R3RoutingAgreementLow",
        f"avg without (layer) (r3operator_routing_agreement_ratio) < {ROUTING_AGREEMENT_MIN}"
        f" and on ({_JOB}) (max by ({_JOB}) (r3operator_replay_active) == 1)",
        "10m",
        "warning",
        "Routing agreement {{ $value | humanizePercentage }} under R3 for {{ $labels.namespace }}/{{ $labels.rljob }}",
        "The trainer's routers agree with the engine's routes on ~98% of token-layers when the routes sit on the "
        "right tokens. This low, the replayed routes land on the wrong tokens (a misaligned batch) or the "
        "policies drifted (stale weights, a failed weight sync). In async mode only the current version's rows "
        "count, so policy drift between versions does not show here.",
        "Replayed routes no longer match what the trainer's routers would choose. A sudden drop to near 0 means "
        "routes are applied to the wrong tokens (a misaligned batch: check the driver log for retokenization or "
        "truncation warnings and `r3operator_routes_invalid_total`); a slow decline means the policies drifted "
        "(check `r3operator_weight_sync_canary_ok` and the weight-sync timings).",
    ),
    Alert(
        "R3RoutesMissing",
        f"sum by ({_JOB}) (increase(r3operator_routes_missing_total[10m])) > 0"
        f" and on ({_JOB}) (max by ({_JOB}) (r3operator_replay_active) == 1)",
        "0m",
        "warning",
        "Samples without routed experts under R3 in {{ $labels.namespace }}/{{ $labels.rljob }}",
        '{{ $value | printf "%.0f" }} samples in 10 m came back without routes; they train without replay. '
        "Check the engine's routed-experts capture and aborted requests.",
        "Samples came back from the engines without routed experts and trained without replay. Check that the "
        "engines were started with routed-experts capture (`r3operator render <job.yaml>` shows the engine "
        "arguments), that no `extraArgs` override it, and the engine log for aborted requests.",
    ),
    Alert(
        "R3RoutesInvalid",
        f"sum by ({_JOB}) (increase(r3operator_routes_invalid_total[10m])) > 0",
        "0m",
        "critical",
        "Invalid routed experts in {{ $labels.namespace }}/{{ $labels.rljob }}",
        '{{ $value | printf "%.0f" }} samples in 10 m had routes that failed validation (row count, id range, '
        "duplicates): the engine and trainer disagree on the model layout.",
        "Routes failed validation (row count, expert id range, duplicates): the engine's model and the "
        "trainer's model disagree on the layout. Check that `spec.model` points at the same checkpoint for both "
        "and that the engine's `--max-model-len` and tokenizer match; the driver drops these samples "
        "(`r3operator_samples_dropped_total`).",
    ),
    Alert(
        "R3NonFiniteUpdate",
        f"sum by ({_JOB}) (increase(r3operator_nonfinite_steps_total[10m])) > 0",
        "0m",
        "warning",
        "Non-finite loss or gradient in {{ $labels.namespace }}/{{ $labels.rljob }}: updates not applied",
        '{{ $value | printf "%.0f" }} step(s) in 10 m had an update whose loss or gradient was not finite; the '
        "trainer skipped it on every rank, nothing non-finite reached an engine or a checkpoint. "
        "spec.algorithm.maxNonFiniteSteps of them in a row fail the job.",
        "The non-finite guard skipped an optimizer step: its loss or some gradient was NaN or infinite on a "
        'trainer rank (docs/runtime.md, "What the loss is"). The weights, AdamW\'s state, the engines and the '
        "checkpoints kept the last applied update; a step that applied none was not synced (no new policy "
        "version) nor checkpointed. `kubectl get rljob <job> -o jsonpath='{.status.progress}'` shows "
        "`nonFiniteSteps` and `lastNonFiniteStep`, the RLJob has a `NonFiniteStep` Warning event, and the driver "
        "log names the step. In metrics.csv look at that step's `reward_mean`, `loss` and `grad_norm`, and the "
        "steps before: (1) a reward (a `task.rewardFunction` or `rewardURL`) that returned NaN or infinity makes "
        "its group's advantages NaN; (2) a `grad_norm` growing over the previous steps means the policy is "
        "diverging (lower `algorithm.learningRate`); a stale or off-policy token alone does not cause it (the "
        "log-ratio is clamped at ±20 before exp, the asynchronous importance weights are truncated). "
        "`spec.algorithm.maxNonFiniteSteps` steps in a row fail the job (condition Failed, the message names "
        "the steps); it resumes from the last checkpoint once the cause is fixed.",
    ),
    Alert(
        "R3ReplayUnhealthy",
        f"(sum by ({_JOB}) (increase(r3operator_route_check_failures_total[10m])) > 0)"
        f" or (max by ({_JOB}) (r3operator_replayed_rows_ratio) < {REPLAYED_FRACTION_MIN})"
        f" or (max by ({_JOB}) (r3operator_replay_fallback_rows_ratio) > {FALLBACK_FRACTION_MAX})"
        f" or ((max by ({_JOB}) (r3operator_extreme_token_ratio) > {EXTREME_TOKEN_FRACTION_MAX})"
        f" and on ({_JOB}) (max by ({_JOB}) (r3operator_replay_active) == 1))",
        "0m",
        "critical",
        "Routing replay is not replaying in {{ $labels.namespace }}/{{ $labels.rljob }}",
        "Route checks failed, too few rows were replayed, or too many tokens are extreme "
        '({{ $value | printf "%.3g" }}). '
        "`kubectl get rlj` shows it under HEALTHY; the ReplayHealthy condition says which.",
        "R3 ran a step that did not replay what it should have. Read the `ReplayHealthy` condition "
        "(`kubectl get rlj <job> -o jsonpath='{.status.conditions[?(@.type==\"ReplayHealthy\")]}'`): its reason and "
        "message name the rule, the sample and the layer. By reason: `RouteCheckFailed`: see "
        '`r3operator_route_check_failures_total` by `rule` and the catalogue in docs/rules.md ("Silent '
        'failures"): `zero-route` means the engines did not capture (a monolithic MoE kernel: check the engine '
        "arguments with `r3operator render`, the `--moe-backend` pin, the vLLM version), `expert-range` means "
        "physical or foreign expert ids (EPLB, a different checkpoint), `hooks-not-fired` means the trainer's "
        "model replaced its routers after the replay hooks were placed, `routes-missing` means capture is off on "
        "the engines; `ReplayedFractionLow`: samples were skipped (`onRouteCheckFailure: SkipSample`) or dropped; "
        "`FallbackHigh`: trained rows routed naturally for want of routes (multi-turn stitching, partial "
        "rollouts); `ExtremeTokens` or `NaturalAgreementLow`: replay runs but engine and trainer disagree (stale "
        "weights: `r3operator_weight_sync_canary_ok`; misaligned routes: R3RoutingAgreementLow).",
    ),
    Alert(
        "R3WeightSyncKernelLayoutRefused",
        f"max by ({_JOB}) (r3operator_weight_sync_kernel_refused) == 1",
        "0m",
        "warning",
        "Kernel weight-sync layout refused for {{ $labels.namespace }}/{{ $labels.rljob }}: syncing in the checkpoint "
        "layout",
        "vLLM's own load_weights disagreed with the kernel layout's build of some parameters at the plan's reference "
        "sync; the weights go on in the checkpoint layout, right and slower. The driver log and "
        "status.progress.weightSync name the parameters.",
        "With `weightSync.layout` `kernel` or `auto`, the first sync of a kernel plan goes in the checkpoint layout "
        "through vLLM's own `load_weights`, and every engine parameter's fingerprint is compared with what the "
        "kernel builder makes of the same tensors. A difference means the builder (or the plan) would have written "
        "a parameter wrong: that sender's syncs stay in the checkpoint layout, so nothing wrong reached the "
        "engines, but every sync pays the slower path (compare `r3operator_weight_sync_seconds` with the job's "
        "earlier runs). `kubectl get rljob <job> -o jsonpath='{.status.progress.weightSync}'` and the driver log "
        "(`weight sync: kernel layout refused`) name the parameters; usually a model or vLLM version whose fused "
        "layout the builder does not know (docs/runtime.md, Weight sync). Report it with those names; set "
        "`weightSync.layout: checkpoint` to make the choice explicit.",
    ),
    Alert(
        "RLJobNoProgress",
        # max by: a standby replica of the operator (leader election) could still hold a job's series.
        f"(time() - max by ({_JOB}) (r3operator_rljob_last_progress_timestamp_seconds))"
        f" > on ({_JOB}) max by ({_JOB}) (r3operator_rljob_no_progress_threshold_seconds)"
        f' and on ({_JOB}) (max by ({_JOB}) (r3operator_rljob_condition{{type="Ready",status="True"}}) == 1)',
        NO_PROGRESS_FOR,
        "warning",
        "RLJob {{ $labels.namespace }}/{{ $labels.rljob }} made no step in {{ $value | humanizeDuration }}",
        "The job is Ready but no step completed for longer than its spec.monitoring.noProgressSeconds. Look at "
        "the trainer logs and r3operator_step_phase_seconds.",
        "The job is Ready but no step completed for longer than `spec.monitoring.noProgressSeconds` (default "
        "900; raise it for models whose steps take longer). Check the trainer head pod's log, "
        "`r3operator_step_phase_seconds` for the phase that stalled, engine readiness "
        "(`kubectl get rljob <job> -o yaml` conditions) and `r3operator_engine_faults_total`.",
    ),
    Alert(
        "RLJobUpgradeBlocked",
        f'max by ({_JOB}) (r3operator_rljob_condition{{type="UpgradeBlocked",status="True"}}) == 1',
        "0m",
        "warning",
        "Engine upgrade of {{ $labels.namespace }}/{{ $labels.rljob }} blocked by its fidelity canary",
        "The new engine image failed the canary and the engines are back on the old one; spec.inference.image "
        "still names the new image. `kubectl describe rlj` shows the figures (condition UpgradeBlocked).",
        "The fidelity canary scored the new engine image worse than the old one and the operator rolled back. "
        "Compare `r3operator_upgrade_canary_logprob_abs_diff` and "
        "`r3operator_upgrade_canary_natural_mismatch_ratio` for engine=old and engine=new, read the condition "
        "message (`kubectl describe rlj <job>`), then either set `spec.inference.image` back to the old image "
        "or fix the new one (its vLLM version, kernels, dtype) and apply it again: a changed image starts a new "
        "attempt (docs/operator.md, engine image upgrades).",
    ),
    Alert(
        "R3OperatorReconcileErrors",
        "sum by (reason) (rate(r3operator_reconcile_errors_total[5m])) > 0",
        f"{RECONCILE_ERROR_MINUTES}m",
        "warning",
        "r3operator reconcile errors ({{ $labels.reason }})",
        f'Reconciles have failed for {RECONCILE_ERROR_MINUTES} m at {{{{ $value | printf "%.2f" }}}}/s '
        "(reason {{ $labels.reason }}). See the operator logs and RLJob events.",
        "Reconcile passes raise. The `reason` label names the exception class; the operator's log and the "
        "RLJob's events (`kubectl describe rljob <job>`) carry the message. `Forbidden` usually means the "
        "operator's Role lacks a verb in a watched namespace; `Conflict` that resolves by itself is harmless.",
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
