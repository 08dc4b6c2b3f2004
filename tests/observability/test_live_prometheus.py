"""Every dashboard expr and rule parses in the real Prometheus and returns series scraped from real exporters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r3operator.observability import dashboards, rules
from r3operator.observability.metrics_contract import substitute_grafana_variables
from r3operator.observability.prom import PromQLError

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "charts/r3operator/dashboards").glob("*.json"))
EXPRS = [
    (p.stem, title, expr) for p in DASHBOARDS for title, expr in dashboards.dashboard_exprs(json.loads(p.read_text()))
]


def test_prometheus_rejects_a_broken_expression(live) -> None:
    prom, _ = live
    with pytest.raises(PromQLError) as err:
        prom.query("sum(rate(r3operator_routing_bytes_total[5m])")
    assert err.value.error_type == "bad_data" and "parse error" in err.value.error


@pytest.mark.parametrize(("uid", "title", "expr"), EXPRS, ids=[f"{u}:{t}" for u, t, _ in EXPRS])
def test_dashboard_expr_returns_series(live, uid: str, title: str, expr: str) -> None:
    prom, _ = live
    query = substitute_grafana_variables(expr, {"namespace": "demo", "rljob": ".*"})
    assert prom.wait_for(query, timeout=15), f"{uid} / {title}: no series for {query}"


def test_dashboard_structure() -> None:
    for path in DASHBOARDS:
        body = json.loads(path.read_text())
        ids = [p["id"] for p in body["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in body["panels"]:
            grid = panel["gridPos"]
            assert all(isinstance(grid[k], int) for k in "hwxy") and grid["x"] + grid["w"] <= 24
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and panel["targets"]
                assert all(t["expr"].strip() for t in panel["targets"])


def test_every_recording_rule_has_series_for_both_vllm_generations(live) -> None:
    prom, _ = live
    for record in rules.recorded_series():
        pods = {s["metric"].get("pod", "") for s in prom.wait_for(record, timeout=15)}
        assert any(p.endswith("vllm-0.30") for p in pods), f"{record}: no series from the vLLM 0.30 names"
        assert any(p.endswith("vllm-legacy") for p in pods), f"{record}: no series from the legacy names"


def test_openmetrics_scrape_stores_vllm_names_with_underscores(live) -> None:
    # Why rules.vllm() matches both spellings: prometheus_client's OpenMetrics output (negotiated by
    # Prometheus) writes `vllm:x` samples as `vllm_x`. If this starts failing, a library fixed it.
    prom, _ = live
    names = {s["metric"]["__name__"] for s in prom.query('{__name__=~"vllm.num_requests_running"}')}
    assert names, "no vLLM series scraped"
    assert names <= {"vllm:num_requests_running", "vllm_num_requests_running"}


def test_every_alert_expr_parses(live) -> None:
    prom, _ = live
    for alert in rules.ALERTS:
        prom.query(alert.expr)  # raises PromQLError on a parse error
