"""`dashboard-preview` draws panels from the live Prometheus to a PNG labelled a preview."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.observability import dashboards
from r3operator.observability.preview import query_panel, render_dashboard

BANNER_RED = np.array([0xB0, 0x00, 0x20]) / 255
LINE_BLUE = np.array([0x1F, 0x77, 0xB4]) / 255  # matplotlib's first line colour (C0)


class RecordedPrometheus:
    """Answers query_range with fixed series and records the PromQL it was asked (the renderer's input)."""

    def __init__(self, series: dict[str, list[dict[str, Any]]]) -> None:
        self.series = series
        self.asked: list[str] = []

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        self.asked.append(expr)
        return self.series.get(expr, [])


def _has_colour(pixels: np.ndarray, colour: np.ndarray, tol: float = 0.06) -> bool:
    return bool((np.abs(pixels[..., :3] - colour) < tol).all(axis=-1).any())


def test_query_panel_substitutes_variables_and_labels_series_by_legend_format() -> None:
    end = 1_000.0
    series = [{"metric": {"__name__": "r3_agree", "layer": "3"}, "values": [[end - 2, "0.5"], [end, "0.75"]]}]
    prom = RecordedPrometheus({'r3_agree{rljob=~"job-a"}': series, 'r3_agree{rljob=~".*"}': series})
    panel = {"targets": [{"expr": 'r3_agree{rljob=~"$rljob"}', "legendFormat": "layer {{layer}}"}]}
    lines = query_panel(prom, panel, end - 10, end, 1.0, {"rljob": "job-a"})  # type: ignore[arg-type]
    assert prom.asked == ['r3_agree{rljob=~"job-a"}']
    assert lines == [("layer 3", [-2.0, 0.0], [0.5, 0.75])]  # times in seconds before `end`
    auto = {"targets": [{"expr": 'r3_agree{rljob=~"$rljob"}', "legendFormat": "__auto"}]}
    assert query_panel(prom, auto, end - 10, end, 1.0)[0][0] == "layer=3"  # type: ignore[arg-type]


def test_render_lays_panels_out_three_wide_under_a_red_preview_banner(tmp_path: Path) -> None:
    now = time.time()
    line = [{"metric": {"layer": "0"}, "values": [[now - 60, "0.2"], [now - 1, "0.9"]]}]
    stat = [{"metric": {}, "values": [[now - 1, "42"]]}]
    prom = RecordedPrometheus({"line_expr": line, "stat_expr": stat})
    dashboard = {
        "title": "synthetic",
        "panels": [
            {"type": "row", "title": "a row is not drawn"},
            {"type": "timeseries", "title": "line", "targets": [{"expr": "line_expr", "legendFormat": "l{{layer}}"}]},
            {"type": "stat", "title": "stat", "targets": [{"expr": "stat_expr"}]},
            {"type": "timeseries", "title": "nothing", "targets": [{"expr": "absent_expr"}]},
            {"type": "timeseries", "title": "also nothing", "targets": [{"expr": "absent_expr"}]},
        ],
    }
    out = render_dashboard(prom, dashboard, tmp_path / "p.png", window=120)  # type: ignore[arg-type]
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    # 4 panels -> 2 rows of 3; figure (3 x 5.2) x (2 x 3.0 + 1.2) inches at 90 dpi.
    assert pixels.shape[:2] == (648, 1404)
    top, body = pixels[: 648 // 10], pixels[648 // 10 :]
    assert _has_colour(top, BANNER_RED)
    assert not _has_colour(body, BANNER_RED)
    third = 1404 // 3
    first_row = pixels[648 // 10 : 648 // 2]
    assert _has_colour(first_row[:, :third], LINE_BLUE)  # the timeseries panel drew its line
    assert not _has_colour(first_row[:, 2 * third :], LINE_BLUE)  # "nothing" has no series to draw
    assert prom.asked == ["line_expr", "stat_expr", "absent_expr", "absent_expr"]


def test_preview_png_from_real_prometheus(live, tmp_path: Path) -> None:
    prom, feed = live
    body = dashboards.dashboard_json(next(d for d in dashboards.dashboards() if d.uid == "r3operator-r3"))
    out = render_dashboard(prom, body, tmp_path / "r3.png", window=20, footnote=str(feed.sources))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layers = next(p for p in body["panels"] if p["title"] == "Routing agreement per layer")
    end = time.time()
    lines = query_panel(prom, layers, end - 20, end, 1)
    assert sorted(legend for legend, _, _ in lines) == sorted(f"layer {i}" for i in range(feed.layers))
    assert all(0.0 <= y <= 1.0 for _, _, ys in lines for y in ys)
    assert all(-20.01 <= x <= 0.01 for _, xs, _ in lines for x in xs)  # Prometheus returns ms timestamps


def test_committed_readme_preview_exists() -> None:
    png = Path(__file__).resolve().parents[2] / "docs/images/dashboard-r3-preview.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
