"""Grafana dashboards as plain JSON built in Python (no SDK dependency).

Every target `expr` is PromQL over the metrics contract (metrics_contract.py) or the stable
`r3operator:*` recording rules (rules.py); tests/observability parse each one in a real Prometheus and
check that it returns series from real exporters. `r3operator dashboards` writes
the JSON into charts/r3operator/dashboards/ for the Grafana-sidecar ConfigMap.

Label conventions (docs/metrics.md): every series carries `namespace` and `rljob`. The operator and the
trainer driver export them as labels (scraped with honorLabels); engine pods get them from the PodMonitor
the operator creates. A `cluster` label, when an aggregating Prometheus (Thanos, Mimir) adds one, selects
the cluster; without one `cluster=~".*"` matches every series.

The variables read only series that a default install scrapes (the trainer and engine PodMonitor of each
RLJob), never the operator's own metrics, whose ServiceMonitor is off by default. Every panel has a 30 s
minimum interval (the PodMonitor's scrape interval), so Grafana's `$__rate_interval` is at least 4 scrapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from r3operator.observability.metrics_contract import ContractMetric, load_contract
from r3operator.observability.rules import RATE_SUFFIX, SCRAPE_INTERVAL_SECONDS

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
CLUSTER = 'cluster=~"$cluster"'
SEL = CLUSTER + ', namespace=~"$namespace", rljob=~"$rljob"'
BY_JOB = "cluster, namespace, rljob"
RI = "$__rate_interval"
MIN_INTERVAL = f"{SCRAPE_INTERVAL_SECONDS}s"


@dataclass
class Target:
    expr: str
    legend: str = ""


@dataclass
class Panel:
    title: str
    targets: list[Target]
    kind: str = "timeseries"  # timeseries | stat
    unit: str = "short"
    width: int = 8
    height: int = 7
    description: str = ""
    thresholds: list[tuple[float | None, str]] = field(default_factory=list)
    mappings: list[dict[str, Any]] = field(default_factory=list)
    minimum: float | None = None
    maximum: float | None = None


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[Panel]]]
    job_variables: bool = True
    tags: tuple[str, ...] = ("r3operator",)
    annotations: tuple[dict[str, Any], ...] = ()
    """Grafana annotation queries (e.g. engine upgrades marked on every time series)."""


UPGRADE_ANNOTATION: dict[str, Any] = {
    "name": "Engine upgrades",
    "enable": True,
    "iconColor": "orange",
    "datasource": DATASOURCE,
    "expr": "max by (namespace, rljob, phase) (r3operator_upgrade_phase{" + SEL + ', phase=~"Canary|Blocked|Complete"})'
    " == 1",
    "step": "1m",
    "titleFormat": "engine upgrade: {{phase}}",
    "textFormat": "{{namespace}}/{{rljob}}",
    "useValueForTime": False,
}


def _sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def _csel(extra: str = "") -> str:
    """Selector of the operator's own series, which have no RLJob to filter on."""
    return "{" + CLUSTER + (", " + extra if extra else "") + "}"


class _Exprs:
    """Type-aware PromQL over the contract, so a metric's type decides gauge vs rate vs histogram mean."""

    def __init__(self) -> None:
        self.metrics: dict[str, ContractMetric] = load_contract().by_name()

    def type_of(self, name: str, assumed: str) -> str:
        metric = self.metrics.get(name)
        return metric.type if metric is not None else assumed

    def value(self, name: str, *, by: str = "", extra: str = "", assumed: str = "gauge") -> str:
        """A gauge as is; a histogram/summary as its mean over the rate interval."""
        kind = self.type_of(name, assumed)
        group = f" by ({by})" if by else f" by ({BY_JOB})"
        if kind in ("histogram", "summary"):
            return (
                f"sum{group} (rate({name}_sum{_sel(extra)}[{RI}])) / sum{group} (rate({name}_count{_sel(extra)}[{RI}]))"
            )
        if kind == "counter":
            series = name if name.endswith("_total") else f"{name}_total"
            return f"sum{group} (rate({series}{_sel(extra)}[{RI}]))"
        return f"max{group} ({name}{_sel(extra)})"


def _job_overview(x: _Exprs) -> Dashboard:
    ready = Panel(
        "Ready",
        [
            Target(
                f"max by ({BY_JOB}) (r3operator_rljob_condition" + _sel('type="Ready", status="True"') + ")",
                "{{rljob}}",
            )
        ],
        kind="stat",
        width=6,
        height=5,
        description="1 when the RLJob's Ready condition is True. From the operator's own metrics: enable "
        "metrics.serviceMonitor (or podMonitor) in the chart.",
        mappings=[
            {
                "type": "value",
                "options": {"0": {"text": "Not ready", "color": "red"}, "1": {"text": "Ready", "color": "green"}},
            }
        ],
        thresholds=[(None, "red"), (1, "green")],
    )
    return Dashboard(
        uid="r3operator-job-overview",
        title="R3 / RLJob overview",
        description="Ready, step, reward and throughput of RLJobs; engine upgrades as annotations.",
        annotations=(UPGRADE_ANNOTATION,),
        rows=[
            (
                "Status",
                [
                    ready,
                    Panel(
                        "Step (status)",
                        [Target(x.value("r3operator_rljob_step"), "{{rljob}}")],
                        kind="stat",
                        width=6,
                        height=5,
                        description="status.step, from the operator's own metrics (chart metrics.serviceMonitor); "
                        "Trainer step below reads the driver.",
                    ),
                    Panel(
                        "Routing replay armed",
                        [Target(x.value("r3operator_replay_active"), "{{rljob}}")],
                        kind="stat",
                        width=6,
                        height=5,
                        mappings=[{"type": "value", "options": {"0": {"text": "off"}, "1": {"text": "on"}}}],
                    ),
                    Panel(
                        "Weight-sync canary",
                        [Target(x.value("r3operator_weight_sync_canary_ok"), "{{rljob}}")],
                        kind="stat",
                        width=6,
                        height=5,
                        thresholds=[(None, "red"), (1, "green")],
                        description="1 when the engine's canary logprobs matched the trainer after the last sync.",
                    ),
                ],
            ),
            (
                "Training",
                [
                    Panel("Trainer step", [Target(x.value("r3operator_step"), "{{rljob}}")]),
                    Panel(
                        "Reward",
                        [
                            Target(x.value("r3operator_reward_mean"), "{{rljob}} training"),
                            Target(x.value("r3operator_eval_reward"), "{{rljob}} held-out eval"),
                        ],
                        description="Mean rollout reward of each step, and the held-out eval reward of the last "
                        "evaluation (spec.evaluation; r3operator_eval_step says after which step it ran).",
                    ),
                    Panel(
                        "Throughput",
                        [Target(x.value("r3operator_tokens_per_second"), "{{rljob}}")],
                        unit="short",
                        description="Tokens per second through the RL loop.",
                    ),
                    Panel(
                        "Step phases",
                        [
                            Target(
                                x.value("r3operator_step_phase_seconds", by=f"{BY_JOB}, phase"), "{{rljob}} {{phase}}"
                            )
                        ],
                        unit="s",
                        width=12,
                    ),
                    Panel(
                        "Weight sync",
                        [Target(x.value("r3operator_weight_sync_seconds"), "{{rljob}}")],
                        unit="s",
                        width=12,
                    ),
                ],
            ),
            ("Asynchronous rollouts (algorithm.mode async)", _async_panels(x)),
        ],
    )


def _async_panels(x: _Exprs) -> list[Panel]:
    staleness = f"r3operator_rollout_staleness_bucket{_sel()}"
    return [
        Panel(
            "Rollout staleness",
            [
                Target(
                    f"histogram_quantile({q}, sum by (namespace, rljob, le) (rate({staleness}[{RI}])))",
                    f"p{round(q * 100)} {{{{rljob}}}}",
                )
                for q in (0.5, 0.9, 1.0)
            ],
            description="Policy versions between a sample's oldest token and the update that takes it from the "
            "rollout queue; samples beyond algorithm.maxStaleness are dropped.",
        ),
        Panel(
            "Partial rollouts and stale drops",
            [
                Target(x.value("r3operator_partial_rollouts_total"), "partial {{rljob}}"),
                Target(x.value("r3operator_samples_dropped_total", extra='reason="stale"'), "dropped stale {{rljob}}"),
            ],
            unit="short",
            description="Samples per second taken from the rollout queue whose tokens span several policy "
            "versions (a weight update interrupted them; they kept their routes), and samples "
            "dropped as older than algorithm.maxStaleness.",
        ),
        Panel(
            "|Δ logprob| by staleness lag",
            [Target(x.value("r3operator_logprob_abs_diff_mean_by_lag", by=f"{BY_JOB}, lag"), "lag {{lag}}")],
            description="Mean |rollout - trainer| logprob of the last step's tokens per staleness lag (the step's "
            'policy version minus the one that sampled the token; ">=N" pools the rest, N = '
            "algorithm.maxStaleness up to 8). lag 0 is the engine/trainer mismatch (alert "
            "R3LogprobDiffSpike); higher lags add policy drift, which the importance weights "
            "correct. A lag without tokens has no point.",
        ),
        Panel(
            "Importance weight (TIS)",
            [Target(x.value("r3operator_importance_weight_mean"), "{{rljob}}")],
            description="Mean truncated importance weight min(pi_old / pi_rollout, cap) over trained tokens: 1 "
            "on-policy; it falls as samples grow stale.",
        ),
    ]


def _r3(x: _Exprs) -> Dashboard:
    def g(name: str) -> str:
        return x.value(name)

    return Dashboard(
        uid="r3operator-r3",
        title="R3 / Rollout Routing Replay",
        description="Rollout-vs-trainer fidelity and routing replay health.",
        rows=[
            (
                "Logprob fidelity",
                [
                    Panel(
                        "|Δ logprob| mean and max",
                        [
                            Target(g("r3operator_logprob_abs_diff_mean"), "mean {{rljob}}"),
                            Target(g("r3operator_logprob_abs_diff_max"), "max {{rljob}}"),
                        ],
                        description="|rollout - trainer| logprob of sampled response tokens, last step.",
                    ),
                    Panel("k3 KL(π_rollout ‖ π_train)", [Target(g("r3operator_kl_k3"), "{{rljob}}")]),
                    Panel(
                        "Extreme tokens (ratio > 2)",
                        [Target(g("r3operator_extreme_token_ratio"), "{{rljob}}")],
                        unit="percentunit",
                    ),
                ],
            ),
            (
                "Routing",
                [
                    Panel(
                        "Routing agreement per layer",
                        [
                            Target(
                                x.value("r3operator_routing_agreement_ratio", by=f"{BY_JOB}, layer"), "layer {{layer}}"
                            )
                        ],
                        unit="percentunit",
                        width=12,
                        minimum=0,
                        maximum=1,
                        description="Alignment health, per MoE layer: tokens whose trainer router's own top-k "
                        "set equals the engine's routes; ~98% aligned, near 0 when routes land on "
                        "the wrong tokens (alert R3RoutingAgreementLow).",
                    ),
                    Panel(
                        "Tokens with any routing difference",
                        [Target(g("r3operator_routing_tokens_any_diff_ratio"), "{{rljob}}")],
                        unit="percentunit",
                        width=12,
                        minimum=0,
                        maximum=1,
                    ),
                    Panel(
                        "Routing agreement per turn (multi-turn)",
                        [
                            Target(
                                x.value("r3operator_routing_agreement_by_turn_ratio", by=f"{BY_JOB}, turn"),
                                "turn {{turn}}",
                            )
                        ],
                        unit="percentunit",
                        width=12,
                        minimum=0,
                        maximum=1,
                        description="Multi-turn rollouts: natural agreement over the tokens each turn's request "
                        "prefilled or generated; a drop at later turns points at the stitching.",
                    ),
                    Panel(
                        "Routing bytes per step",
                        [
                            Target(
                                f"sum by ({BY_JOB}) (increase(r3operator_routing_bytes_total{_sel()}[5m]))"
                                f" / clamp_min(max by ({BY_JOB}) (delta(r3operator_step{_sel()}[5m])), 1)",
                                "{{rljob}}",
                            )
                        ],
                        unit="bytes",
                        description="Routed-expert payload received per trainer step (5 m average).",
                    ),
                    Panel(
                        "Missing / invalid routes",
                        [
                            Target(
                                f"sum by ({BY_JOB}) (increase(r3operator_routes_missing_total{_sel()}[5m]))", "missing"
                            ),
                            Target(
                                f"sum by ({BY_JOB}) (increase(r3operator_routes_invalid_total{_sel()}[5m]))", "invalid"
                            ),
                        ],
                        description="Samples per 5 m without routes, or with routes that failed validation.",
                    ),
                    Panel("Replay armed", [Target(g("r3operator_replay_active"), "{{rljob}}")], minimum=0, maximum=1),
                ],
            ),
        ],
    )


def _engines() -> Dashboard:
    def r(record: str, legend: str = "{{pod}}") -> Target:
        return Target(f"{record}{_sel()}", legend)

    return Dashboard(
        uid="r3operator-engines",
        title="R3 / vLLM engines",
        description="vLLM engines through the stable r3operator:engine_* recording rules (any vLLM version).",
        rows=[
            (
                "Load",
                [
                    Panel("Requests running", [r("r3operator:engine_requests_running")]),
                    Panel("Requests waiting", [r("r3operator:engine_requests_waiting")]),
                    Panel(
                        "KV-cache usage",
                        [r("r3operator:engine_kv_cache_usage_ratio")],
                        unit="percentunit",
                        minimum=0,
                        maximum=1,
                    ),
                ],
            ),
            (
                "Throughput",
                [
                    Panel("Generation tokens/s", [r(f"r3operator:engine_generation_tokens:{RATE_SUFFIX}")]),
                    Panel("Prompt tokens/s", [r(f"r3operator:engine_prompt_tokens:{RATE_SUFFIX}")]),
                    Panel(
                        "Finished requests/s and preemptions/s",
                        [
                            r(f"r3operator:engine_requests_finished:{RATE_SUFFIX}", "finished {{pod}}"),
                            r(f"r3operator:engine_preemptions:{RATE_SUFFIX}", "preempted {{pod}}"),
                        ],
                    ),
                ],
            ),
            (
                "Latency",
                [
                    Panel(
                        "E2E latency p50 / p95",
                        [
                            r("r3operator:engine_e2e_latency_seconds:p50", "p50 {{pod}}"),
                            r("r3operator:engine_e2e_latency_seconds:p95", "p95 {{pod}}"),
                        ],
                        unit="s",
                    ),
                    Panel("TTFT p95", [r("r3operator:engine_ttft_seconds:p95")], unit="s"),
                    Panel("Inter-token latency p95", [r("r3operator:engine_itl_seconds:p95")], unit="s"),
                    Panel(
                        "Prefix-cache hit ratio", [r("r3operator:engine_prefix_cache_hit_ratio")], unit="percentunit"
                    ),
                ],
            ),
        ],
    )


READY = 'type="Ready", status="True"'


def _operator(x: _Exprs) -> Dashboard:
    dur = "r3operator_reconcile_duration_seconds"
    return Dashboard(
        uid="r3operator-operator",
        title="R3 / operator health",
        description="Reconcile rate, errors and latency of the r3operator controller; RLJobs by condition.",
        job_variables=False,
        rows=[
            (
                "Reconcile",
                [
                    Panel(
                        "Reconciles/s by result",
                        [Target(f"sum by (result) (rate(r3operator_reconcile_total{_csel()}[{RI}]))", "{{result}}")],
                    ),
                    Panel(
                        "Reconcile errors/s by reason",
                        [
                            Target(
                                f"sum by (reason) (rate(r3operator_reconcile_errors_total{_csel()}[{RI}]))",
                                "{{reason}}",
                            )
                        ],
                    ),
                    Panel(
                        "Reconcile duration p50 / p99",
                        [
                            Target(f"histogram_quantile(0.5, sum by (le) (rate({dur}_bucket{_csel()}[{RI}])))", "p50"),
                            Target(f"histogram_quantile(0.99, sum by (le) (rate({dur}_bucket{_csel()}[{RI}])))", "p99"),
                        ],
                        unit="s",
                    ),
                ],
            ),
            (
                "RLJobs",
                [
                    Panel("RLJobs", [Target(f"count(r3operator_rljob_info{_csel()})", "RLJobs")], kind="stat", width=6),
                    Panel(
                        "RLJobs Ready",
                        [Target(f"count(r3operator_rljob_condition{_csel(READY)} == 1) or vector(0)", "Ready")],
                        kind="stat",
                        width=6,
                    ),
                    Panel(
                        "RLJobs by vLLM version and replay mode",
                        [
                            Target(
                                "count by (vllm_version, replay_mode, trainer_backend) "
                                f"(r3operator_rljob_info{_csel()})",
                                "{{vllm_version}} {{replay_mode}} {{trainer_backend}}",
                            )
                        ],
                        width=12,
                    ),
                ],
            ),
        ],
    )


# --- JSON ---------------------------------------------------------------------------------------------------


def _query_variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
    }


# Any series of an RLJob's pods: the trainer driver and the engines, scraped by the PodMonitor the operator
# creates for every RLJob by default.
_RLJOB_SERIES = '{rljob!="", ' + CLUSTER


def _variables(job_variables: bool) -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        },
        # `up` exists for every target Prometheus scrapes; no `cluster` label leaves only "All".
        _query_variable("cluster", "label_values(up, cluster)"),
    ]
    if job_variables:
        variables.append(_query_variable("namespace", f"label_values({_RLJOB_SERIES}}}, namespace)"))
        variables.append(_query_variable("rljob", f'label_values({_RLJOB_SERIES}, namespace=~"$namespace"}}, rljob)'))
    return variables


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    steps = [{"color": color, "value": value} for value, color in (panel.thresholds or [(None, "green")])]
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "thresholds": {"mode": "absolute", "steps": steps},
        "mappings": panel.mappings,
    }
    if panel.minimum is not None:
        defaults["min"] = panel.minimum
    if panel.maximum is not None:
        defaults["max"] = panel.maximum
    options: dict[str, Any]
    if panel.kind == "stat":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    else:
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "interval": MIN_INTERVAL,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": t.expr,
                "legendFormat": t.legend or "__auto",
                "range": True,
            }
            for i, t in enumerate(panel.targets)
        ],
    }


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    panel_id, y = 1, 0
    for row_title, row_panels in dashboard.rows:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y, x, row_height = panel_id + 1, y + 1, 0, 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y, row_height = 0, y + row_height, 0
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id, x, row_height = panel_id + 1, x + panel.width, max(row_height, panel.height)
        y += row_height
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": list(dashboard.tags),
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": _variables(dashboard.job_variables)},
        "annotations": {"list": [dict(a) for a in dashboard.annotations]},
        "links": [],
        "panels": panels,
    }


def dashboards() -> list[Dashboard]:
    x = _Exprs()
    return [_job_overview(x), _r3(x), _engines(), _operator(x)]


def render_dashboards() -> dict[str, str]:
    """File name -> JSON text (stable formatting, so the committed files can be compared)."""
    return {f"{d.uid}.json": json.dumps(dashboard_json(d), indent=2, ensure_ascii=False) + "\n" for d in dashboards()}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of a dashboard JSON."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
