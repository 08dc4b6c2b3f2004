"""`dashboard-preview` draws panels from the live Prometheus to a PNG labelled a preview."""

from __future__ import annotations

from pathlib import Path

from r3operator.observability import dashboards
from r3operator.observability.preview import BANNER, query_panel, render_dashboard


def test_preview_png_from_real_prometheus(live, tmp_path: Path) -> None:
    prom, feed = live
    body = dashboards.dashboard_json(next(d for d in dashboards.dashboards() if d.uid == "r3operator-r3"))
    out = render_dashboard(prom, body, tmp_path / "r3.png", window=20, footnote=str(feed.sources))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert "not a Grafana screenshot" in BANNER
    layers = next(p for p in body["panels"] if p["title"] == "Routing agreement per layer")
    import time

    lines = query_panel(prom, layers, time.time() - 20, time.time(), 1)
    assert sorted(legend for legend, _, _ in lines) == [f"layer {i}" for i in range(feed.layers)]
    assert all(0.0 <= y <= 1.0 for _, _, ys in lines for y in ys)


def test_committed_readme_preview_exists() -> None:
    png = Path(__file__).resolve().parents[2] / "docs/images/dashboard-r3-preview.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
