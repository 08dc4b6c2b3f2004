"""`r3operator run FILE`: train an RLJob on this machine (mounted by cli/main.py: `app.command("run")(run)`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def run(
    file: Annotated[Path, typer.Argument(help="RLJob YAML file, e.g. examples/rljob-local.yaml.")],
    compare_replay: Annotated[
        bool, typer.Option("--compare-replay", help="Run the same seed with replay off, then R3; one plot.")
    ] = False,
    steps: Annotated[int | None, typer.Option(help="Override spec.algorithm.steps (env R3_STEPS).")] = None,
    out_dir: Annotated[Path, typer.Option(help="Runs are written to OUT_DIR/<job name>/.")] = Path("runs"),
    resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint if there is one.")] = True,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    model: Annotated[
        str | None, typer.Option(help="Reference model name or model directory (env R3_MODEL), e.g. gpu.")
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port (0/unset: off locally).")] = None,
) -> None:
    """Train an RLJob locally: vLLM engine in a Ray actor, GRPO trainer, R3/R2/Disabled replay."""
    from r3operator.api import RLJobLoadError
    from r3operator.runtime.app import build_settings, run_job

    try:
        settings = build_settings(
            file, steps=steps, out_dir=out_dir, resume=resume, device=device, model=model, metrics_port=metrics_port
        )
    except (RLJobLoadError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    out = run_job(settings, compare_replay=compare_replay)
    typer.echo(f"run directory: {out}")
