"""Draw a dashboard's panels to PNG from a real Prometheus (query_range per target), with matplotlib.

Not Grafana: the picture is labelled a preview. Each panel runs its targets' exprs (Grafana variables
substituted) over the window and draws timeseries as lines and stat panels as their last value.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r3operator.observability.metrics_contract import substitute_grafana_variables
from r3operator.observability.prom import PrometheusServer

BANNER = "PREVIEW — rendered from real Prometheus data, not a Grafana screenshot"
_UNIT_LABEL = {"s": "seconds", "bytes": "bytes", "percentunit": "ratio", "short": ""}


def _legend(fmt: str, labels: Mapping[str, str]) -> str:
    if not fmt or fmt == "__auto":
        return ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def query_panel(
    prom: PrometheusServer,
    panel: Mapping[str, Any],
    start: float,
    end: float,
    step: float,
    variables: Mapping[str, str] | None = None,
) -> list[tuple[str, list[float], list[float]]]:
    """(legend, times relative to `end` in s, values) for every series of every target of the panel."""
    lines: list[tuple[str, list[float], list[float]]] = []
    for target in panel.get("targets", []):
        expr = substitute_grafana_variables(target["expr"], dict(variables or {}))
        for series in prom.query_range(expr, start, end, step):
            xs = [float(t) - end for t, _ in series["values"]]
            ys = [float(v) for _, v in series["values"]]
            lines.append((_legend(target.get("legendFormat", ""), series["metric"]), xs, ys))
    return lines


def render_dashboard(
    prom: PrometheusServer,
    dashboard: Mapping[str, Any],
    out: Path,
    *,
    window: float = 120.0,
    step: float = 1.0,
    variables: Mapping[str, str] | None = None,
    footnote: str = "",
    span: tuple[float, float] | None = None,
    banner: str = BANNER,
) -> Path:
    """The dashboard's panels over the last `window` seconds (x: seconds before the render), or over `span`
    (start, end: a finished run's, x: minutes into it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    start, end = span if span is not None else (time.time() - window, time.time())
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.2, rows * 3.0 + 1.2), squeeze=False)
    fig.suptitle(f"{banner}\n{dashboard['title']}", fontsize=13, fontweight="bold", color="#b00020")
    for ax, panel in zip(axes.flat, panels, strict=False):
        lines = query_panel(prom, panel, start, end, step, variables)
        if span is not None:  # minutes into the run, not seconds before the render
            lines = [(legend, [(x + end - start) / 60.0 for x in xs], ys) for legend, xs, ys in lines]
        ax.set_title(panel["title"], fontsize=10, loc="left")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        if not lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
        elif panel["type"] == "stat":
            ax.axis("off")
            text = "\n".join(f"{legend}: {ys[-1]:.4g}" for legend, _, ys in lines[:4] if ys)
            ax.text(0.5, 0.45, text, ha="center", va="center", transform=ax.transAxes, fontsize=14)
        else:
            # At most 12 lines, the largest on average first: the step's rollout and update, not its checkpoint.
            biggest = sorted(lines, key=lambda line: -sum(line[2]) / max(len(line[2]), 1))[:12]
            for legend, xs, ys in sorted(biggest, key=lambda line: line[0]):
                ax.plot(xs, ys, linewidth=1.2, label=legend[:40])
            ax.set_xlabel("minutes into the run" if span is not None else "seconds before render", fontsize=8)
            ax.set_ylabel(_UNIT_LABEL.get(unit, unit), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if footnote:
        fig.text(0.01, 0.005, footnote, fontsize=7, color="#555555", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
