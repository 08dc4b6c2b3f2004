"""The metrics contract: what the operator, trainer and runtime export, and the vLLM metrics we read.

The names come from the `METRICS` lists next to the code that exports them (never duplicated here):
`r3operator.operator.metrics`, `r3operator.trainer.metrics`, `r3operator.runtime.metrics`.
A dashboard or rule may query only series in :func:`produced_series` (tests/observability check it).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SOURCES: dict[str, str] = {
    "operator": "r3operator.operator.metrics",
    "trainer": "r3operator.trainer.metrics",
    "runtime": "r3operator.runtime.metrics",
}

# Series Prometheus itself adds for every target; dashboards may use them.
PROMETHEUS_SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


@dataclass(frozen=True)
class ContractMetric:
    name: str
    type: str  # gauge | counter | histogram | summary | info
    labels: tuple[str, ...]
    help: str
    source: str  # operator | trainer | runtime

    def series(self) -> tuple[str, ...]:
        """The series names Prometheus stores for this metric once scraped."""
        if self.type == "counter":
            return (self.name if self.name.endswith("_total") else f"{self.name}_total",)
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.type == "summary":
            return (self.name, f"{self.name}_sum", f"{self.name}_count")
        if self.type == "info":
            return (self.name if self.name.endswith("_info") else f"{self.name}_info",)
        return (self.name,)


def _as_contract(spec: Any, source: str) -> ContractMetric:
    # Each area owns its spec class (operator MetricDef, trainer/runtime MetricSpec); all share
    # name/type/labels/help.
    return ContractMetric(spec.name, spec.type, tuple(spec.labels), spec.help, source)


@dataclass(frozen=True)
class Contract:
    metrics: tuple[ContractMetric, ...]
    missing: dict[str, str]  # source -> why its METRICS list could not be imported

    def by_name(self) -> dict[str, ContractMetric]:
        return {m.name: m for m in self.metrics}


def load_contract(sources: Iterable[str] = SOURCES) -> Contract:
    metrics: list[ContractMetric] = []
    missing: dict[str, str] = {}
    for source in sources:
        module_name = SOURCES[source]
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing[source] = f"{module_name} cannot be imported ({exc})"
            continue
        specs = getattr(module, "METRICS", None)
        if specs is None:
            missing[source] = f"{module_name} has no METRICS list"
            continue
        metrics.extend(_as_contract(spec, source) for spec in specs)
    return Contract(tuple(metrics), missing)


# --- vLLM engine metrics --------------------------------------------------------------------------------
#
# vLLM deprecates a metric in X.Y, hides it in X.Y+1 (re-enabled by --show-hidden-metrics-for-version)
# and removes it in X.Y+2. The `gpu_` names were deprecated by vllm-project/vllm#18354 and removed by
# #29330; `time_per_output_token_seconds` was split into `inter_token_latency_seconds` and
# `request_time_per_output_token_seconds` (#24110). Recording rules (rules.py) read the current name
# OR the legacy one, so one dashboard covers engines on either side of a rename.


@dataclass(frozen=True)
class VllmMetric:
    name: str  # as registered in vLLM (counters without `_total`, histograms without suffix)
    type: str
    labels: tuple[str, ...]
    current: bool  # True: exported by vLLM 0.30.0 (verified against its source by a test)
    note: str
    replaced_by: str | None = None  # legacy metrics: the current name that replaced it

    def series(self) -> tuple[str, ...]:
        return ContractMetric(self.name, self.type, self.labels, self.note, "vllm").series()


_ENGINE = ("model_name", "engine")

VLLM_METRICS: tuple[VllmMetric, ...] = (
    VllmMetric("vllm:num_requests_running", "gauge", _ENGINE, True, "Requests in model execution batches."),
    VllmMetric("vllm:num_requests_waiting", "gauge", _ENGINE, True, "Requests waiting to be scheduled."),
    VllmMetric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        _ENGINE,
        True,
        "KV-cache usage, 1 = 100 %. Replaced vllm:gpu_cache_usage_perc (#18354).",
    ),
    VllmMetric(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        _ENGINE,
        False,
        "Legacy name of vllm:kv_cache_usage_perc; removed by #29330.",
        "vllm:kv_cache_usage_perc",
    ),
    VllmMetric("vllm:prompt_tokens", "counter", _ENGINE, True, "Prefill tokens processed."),
    VllmMetric("vllm:generation_tokens", "counter", _ENGINE, True, "Generation tokens processed."),
    VllmMetric(
        "vllm:request_success", "counter", (*_ENGINE, "finished_reason"), True, "Finished requests by finish reason."
    ),
    VllmMetric("vllm:num_preemptions", "counter", _ENGINE, True, "Cumulative preemptions."),
    VllmMetric(
        "vllm:prefix_cache_queries",
        "counter",
        _ENGINE,
        True,
        "Prefix-cache queried tokens. Replaced vllm:gpu_prefix_cache_queries (#18354).",
    ),
    VllmMetric(
        "vllm:prefix_cache_hits",
        "counter",
        _ENGINE,
        True,
        "Prefix-cache hit tokens. Replaced vllm:gpu_prefix_cache_hits (#18354).",
    ),
    VllmMetric(
        "vllm:gpu_prefix_cache_queries",
        "counter",
        _ENGINE,
        False,
        "Legacy name of vllm:prefix_cache_queries; removed by #29330.",
        "vllm:prefix_cache_queries",
    ),
    VllmMetric(
        "vllm:gpu_prefix_cache_hits",
        "counter",
        _ENGINE,
        False,
        "Legacy name of vllm:prefix_cache_hits; removed by #29330.",
        "vllm:prefix_cache_hits",
    ),
    VllmMetric("vllm:e2e_request_latency_seconds", "histogram", _ENGINE, True, "End-to-end request latency."),
    VllmMetric("vllm:time_to_first_token_seconds", "histogram", _ENGINE, True, "Time to first token."),
    VllmMetric(
        "vllm:inter_token_latency_seconds",
        "histogram",
        _ENGINE,
        True,
        "Inter-token latency. Replaced vllm:time_per_output_token_seconds (#24110).",
    ),
    VllmMetric(
        "vllm:time_per_output_token_seconds",
        "histogram",
        _ENGINE,
        False,
        "Legacy name of vllm:inter_token_latency_seconds; hidden, then removed.",
        "vllm:inter_token_latency_seconds",
    ),
)


def vllm_series(*, current_only: bool = False) -> set[str]:
    """vLLM series names, also in the `vllm_` form an OpenMetrics scrape of prometheus_client stores."""
    names = {s for m in VLLM_METRICS if m.current or not current_only for s in m.series()}
    return names | {n.replace(":", "_") for n in names}


def produced_series(contract: Contract, recorded: Iterable[str] = ()) -> set[str]:
    """Every series name a dashboard may query: exported, recorded, vLLM, or Prometheus' own."""
    names = {s for m in contract.metrics for s in m.series()}
    return names | set(recorded) | vllm_series() | PROMETHEUS_SYNTHETIC


# --- PromQL metric selectors -----------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])")
_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
        "Inf",
        "NaN",
        "start",
        "end",
        "atan2",
    }
)
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__interval": "15s", "$__range": "1h"}


def substitute_grafana_variables(expr: str, values: dict[str, str] | None = None) -> str:
    """Make a dashboard expr plain PromQL: interval macros -> durations, `$var` -> `values` or `.*`."""
    for macro, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(macro, value)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: (values or {}).get(m.group(1), ".*"), expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (`foo{...}`, `foo[5m]`, bare `foo`); functions excluded."""
    text = _STRING.sub('""', substitute_grafana_variables(expr))
    # `{__name__=~"a|b"}`: an alternation of plain names (rules.vllm); other regexes are not allowed.
    names = {n for alt in re.findall(r'__name__\s*=~?\s*"([^"]*)"', expr) for n in alt.split("|")}
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    for match in _IDENT.finditer(text):
        word = match.group(1)
        following = text[match.end() :].lstrip()
        if word in _KEYWORDS or following.startswith("("):
            continue
        names.add(word)
    return names
