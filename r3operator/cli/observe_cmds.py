"""`r3operator dashboard-preview` and `r3operator dashboards` (typer-compatible functions).

Mounted in r3operator/cli/main.py with::

    from r3operator.cli import observe_cmds
    app.command("dashboard-preview")(observe_cmds.dashboard_preview)
    app.command("dashboards")(observe_cmds.dashboards)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_PNG = Path("docs/images/dashboard-r3-preview.png")


def dashboard_preview(
    dashboard: Annotated[str, typer.Option(help="Dashboard uid, or `all` (one PNG per dashboard).")] = "r3operator-r3",
    out: Annotated[Path, typer.Option(help="PNG path (a directory when --dashboard all).")] = DEFAULT_PNG,
    seconds: Annotated[float, typer.Option(help="How long to let Prometheus scrape before drawing.")] = 75.0,
    target: Annotated[
        list[str] | None,
        typer.Option(
            help="host:port of a real exporter to scrape too (e.g. the local run's driver), "
            "as `job=host:port` or `host:port`; repeatable."
        ),
    ] = None,
    synthetic: Annotated[bool, typer.Option(help="Also run the synthetic feed (real exporter classes).")] = True,
    namespace: Annotated[str, typer.Option(help="Value of the $namespace variable (regex).")] = ".*",
    rljob: Annotated[str, typer.Option(help="Value of the $rljob variable (regex).")] = ".*",
) -> None:
    """Render dashboard panels to PNG from a real Prometheus that scrapes real exporters (a preview)."""
    from r3operator.observability import dashboards as dash
    from r3operator.observability.feed import SyntheticFeed
    from r3operator.observability.generate import RULES_FILE
    from r3operator.observability.preview import render_dashboard
    from r3operator.observability.prom import PrometheusNotFound, PrometheusServer, ScrapeTarget

    bodies = {d.uid: dash.dashboard_json(d) for d in dash.dashboards()}
    if dashboard != "all" and dashboard not in bodies:
        raise typer.BadParameter(
            f"unknown dashboard {dashboard!r}; one of {', '.join(bodies)} or all", param_hint="--dashboard"
        )
    targets = []
    for i, spec in enumerate(target or []):
        job, _, address = spec.rpartition("=")
        targets.append(ScrapeTarget(job or f"external-{i}", address))
    if not synthetic and not targets:
        raise typer.BadParameter("nothing to scrape: give --target or keep --synthetic", param_hint="--target")
    rules_file = Path(RULES_FILE)
    if not rules_file.exists():
        from r3operator.observability.rules import render_rules_yaml

        rules_file = Path(typer.get_app_dir("r3operator")) / "r3operator.rules.yaml"
        rules_file.parent.mkdir(parents=True, exist_ok=True)
        rules_file.write_text(render_rules_yaml())

    feed = SyntheticFeed(tick_seconds=0.25) if synthetic else None
    try:
        if feed is not None:
            feed.start()
            targets += feed.targets()
        with PrometheusServer(targets, [rules_file]) as prom:
            typer.echo(f"prometheus {prom.url} scraping {len(targets)} targets; waiting {seconds:g}s")
            time.sleep(seconds)
            sources = "; ".join(f"{k}: {v}" for k, v in (feed.sources if feed else {}).items())
            external = ", ".join(t.address for t in targets if not t.job.startswith("r3-"))
            footnote = f"Scraped: {sources}" + (f"; external: {external}" if external else "")
            chosen = bodies if dashboard == "all" else {dashboard: bodies[dashboard]}
            for uid, body in chosen.items():
                path = out / f"{uid}-preview.png" if dashboard == "all" else out
                render_dashboard(
                    prom,
                    body,
                    path,
                    window=seconds,
                    variables={"namespace": namespace, "rljob": rljob},
                    footnote=footnote,
                )
                typer.echo(f"wrote {path}")
    except PrometheusNotFound as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    finally:
        if feed is not None:
            feed.stop()


def dashboards(
    check: Annotated[bool, typer.Option(help="Exit 1 if a committed generated file is stale.")] = False,
    print_uid: Annotated[str | None, typer.Option("--print", help="Print one dashboard's JSON.")] = None,
    root: Annotated[Path, typer.Option(help="Repository root the generated files live under.")] = Path("."),
) -> None:
    """Regenerate the dashboards, rules, chart CRD copy and docs/metrics.md (or check them)."""
    from r3operator.observability import dashboards as dash
    from r3operator.observability.generate import stale_files, write_files

    if print_uid:
        bodies = {d.uid: dash.dashboard_json(d) for d in dash.dashboards()}
        if print_uid not in bodies:
            known = ", ".join(bodies)
            raise typer.BadParameter(f"unknown dashboard {print_uid!r}; one of {known}", param_hint="--print")
        typer.echo(json.dumps(bodies[print_uid], indent=2, ensure_ascii=False))
        return
    if check:
        stale = stale_files(root)
        for path in stale:
            typer.echo(f"stale: {path} (run r3operator dashboards)", err=True)
        raise typer.Exit(1 if stale else 0)
    for path in write_files(root):
        typer.echo(f"wrote {path}")
