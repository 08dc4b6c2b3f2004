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
from typing import Annotated, Any

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
    run: Annotated[
        list[str] | None,
        typer.Option(
            help="A finished run to draw instead of live exporters: its directory or metrics.csv, as `name=PATH` or "
            "`PATH` (the rljob label); repeatable, the runs drawn as started together. Its rows are played through "
            "the driver's exporter into a real Prometheus (observability/backfill.py)."
        ),
    ] = None,
) -> None:
    """Render dashboard panels to PNG from a real Prometheus that scrapes real exporters (a preview)."""
    if run:
        _run_preview(run, dashboard=dashboard, out=out, namespace=namespace, rljob=rljob)
        return
    from r3operator.observability.feed import SyntheticFeed
    from r3operator.observability.generate import RULES_FILE
    from r3operator.observability.preview import render_dashboard
    from r3operator.observability.prom import PrometheusNotFound, PrometheusServer, ScrapeTarget

    chosen = _chosen_dashboards(dashboard)
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


def _chosen_dashboards(dashboard: str) -> dict[str, Any]:
    """`--dashboard`'s bodies by uid: one, or `all`; an unknown uid is refused naming the ones there are."""
    from r3operator.observability import dashboards as dash

    bodies = {d.uid: dash.dashboard_json(d) for d in dash.dashboards()}
    if dashboard == "all":
        return bodies
    if dashboard not in bodies:
        raise typer.BadParameter(
            f"unknown dashboard {dashboard!r}; one of {', '.join(bodies)} or all", param_hint="--dashboard"
        )
    return {dashboard: bodies[dashboard]}


def _run_preview(runs: list[str], *, dashboard: str, out: Path, namespace: str, rljob: str) -> None:
    """`dashboard-preview --run`: the dashboards over finished runs' metrics.csv (observability/backfill.py)."""
    import tempfile

    from r3operator.observability.backfill import BackfillError, backfill, read_run
    from r3operator.observability.preview import render_dashboard
    from r3operator.observability.prom import PrometheusNotFound, PrometheusServer, find_binary

    chosen = _chosen_dashboards(dashboard)
    try:
        played = []
        for spec in runs:
            name, _, where = spec.rpartition("=")
            played.append(read_run(Path(where), name or None))
    except BackfillError as exc:
        raise typer.BadParameter(str(exc), param_hint="--run") from None
    promtool = find_binary("promtool")
    if promtool is None:
        typer.echo("error: promtool not found on PATH or in .tools/bin (run `make tools`)", err=True)
        raise typer.Exit(2)
    length = max(r.seconds for r in played)
    end = float(int(time.time()) - 60)  # the runs end just before now: inside the server's retention
    start = end - length
    names = ", ".join(f"{r.rljob} ({len(r.rows)} steps, {r.path})" for r in played)
    with tempfile.TemporaryDirectory(prefix="r3-backfill-") as tmp:
        try:
            blocks = backfill(played, start, Path(tmp) / "blocks", promtool=promtool)
            with PrometheusServer([], blocks=blocks, retention=f"{int(length // 3600) + 2}h") as prom:
                for uid, body in chosen.items():
                    path = out / f"{uid}-run.png" if dashboard == "all" else out
                    render_dashboard(
                        prom,
                        body,
                        path,
                        span=(start, end),
                        step=max(1.0, length / 400),
                        variables={"namespace": namespace, "rljob": rljob},
                        banner="PREVIEW — finished runs' metrics.csv played through the driver's exporter into a "
                        "real Prometheus, not a Grafana screenshot",
                        footnote=f"Runs (started together; a step ends at the sum of its run's step_seconds): {names}",
                    )
                    typer.echo(f"wrote {path}")
        except BackfillError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        except PrometheusNotFound as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None


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
