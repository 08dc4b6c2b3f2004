"""`r3operator run`: train an RLJob, from a file on a workstation or from the operator's ConfigMap in the
trainer pod (`r3operator run --config /etc/r3operator/config.json`, the RayJob entrypoint).

`r3operator reference-model NAME` generates (or finds) a reference model and prints its directory.
Mounted by cli/main.py; `python -m r3operator run` is the same command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from r3operator.settings import CONFIG_PATH


def run(
    file: Annotated[
        Path | None, typer.Argument(help="RLJob YAML file, e.g. examples/rljob-local.yaml.", show_default=False)
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help=f"The operator's runtime config instead of FILE (in the trainer pod: {CONFIG_PATH})."),
    ] = None,
    compare_replay: Annotated[
        bool, typer.Option("--compare-replay", help="Run the same seed with replay off, then R3; one plot.")
    ] = False,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Override spec.algorithm.steps (env R3OPERATOR_STEPS).")
    ] = None,
    out_dir: Annotated[
        Path, typer.Option(help="Runs go to OUT_DIR/<job name>/ (unless a config has routingDir).")
    ] = Path("runs"),
    resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint if there is one.")] = True,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    model: Annotated[
        str | None, typer.Option(help="Reference model name or model directory (env R3OPERATOR_MODEL), e.g. a3b.")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Prometheus port; 0 = off (default: off for FILE, spec.monitoring.port for --config)."),
    ] = None,
    trainer_ranks: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Trainer ranks, one Ray actor each, FSDP2 across them (env R3OPERATOR_TRAINER_RANKS; "
            "default: trainer.nodes × gpusPerNode on CUDA, 1 on CPU).",
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No live step table, no report on stdout.")] = False,
) -> None:
    """Train an RLJob: vLLM engines (Ray actors, or a cluster's engine Services), GRPO, R3/R2/Disabled replay."""
    from r3operator.api import RLJobLoadError
    from r3operator.runtime.app import build_settings, run_job

    if (file is None) == (config is None):
        problem = "not both" if file is not None else "one of them"
        typer.echo(f"error: give an RLJob FILE or --config ({problem})", err=True)
        raise typer.Exit(2)
    try:
        settings = build_settings(
            file,
            config=config,
            steps=steps,
            out_dir=out_dir,
            resume=resume,
            device=device,
            model=model,
            metrics_port=metrics_port,
            trainer_ranks=trainer_ranks,
        )
    except (RLJobLoadError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    settings.show_progress = not quiet
    out = run_job(settings, compare_replay=compare_replay)
    typer.echo(f"run directory: {out}")


def reference_model(
    name: Annotated[
        str, typer.Argument(help="tiny, small, gpu or a3b (4 layers shaped as Qwen3-30B-A3B's; GPU-sized).")
    ] = "tiny",
    cache_dir: Annotated[
        Path | None, typer.Option(help="Where models are generated (default: R3OPERATOR_CACHE_DIR/models).")
    ] = None,
) -> None:
    """Generate a reference MoE model (deterministic, no download) if it is not cached; print its directory."""
    from r3operator.models import ensure_reference_model

    try:
        path = ensure_reference_model(name, cache_dir)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(path))


def upgrade_canary(
    config: Annotated[Path, typer.Option(help=f"The operator's runtime config (in the pod: {CONFIG_PATH}).")],
    new: Annotated[str, typer.Option(help="URL of the engine replica to score (the new one, for an engine upgrade).")],
    new_image: Annotated[str, typer.Option(help="The image under test (engine or trainer), for the figures.")] = "",
    old: Annotated[str | None, typer.Option(help="Engine upgrade: URL of a replica on the current image.")] = None,
    old_image: Annotated[str, typer.Option(help="The current image (engine or trainer), for the figures.")] = "",
    attempt: Annotated[str, typer.Option(help="The upgrade attempt the verdict answers.")] = "",
    new_prefill: Annotated[
        str | None, typer.Option(help="Disaggregated job: the prefill replica paired with --new (on the new image).")
    ] = None,
    old_prefill: Annotated[
        str | None, typer.Option(help="Disaggregated job: the prefill replica paired with --old.")
    ] = None,
    score_only: Annotated[
        Path | None, typer.Option(help="Trainer upgrade, old image: write this trainer's figures here, no verdict.")
    ] = None,
    baseline: Annotated[
        Path | None, typer.Option(help="Trainer upgrade, new image: compare with the old trainer's figures here.")
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    model: Annotated[
        str | None, typer.Option(help="Reference model name or model directory instead of the job's model.")
    ] = None,
) -> None:
    """The upgrade canary (the operator's Job): score engine replicas with the trainer, write the verdict."""
    from r3operator.api import RLJobLoadError
    from r3operator.runtime import upgrade_canary as canary
    from r3operator.runtime.app import build_settings

    modes = [m for m, on in (("--old", old is not None), ("--score-only", score_only), ("--baseline", baseline)) if on]
    if len(modes) != 1:
        typer.echo(f"error: give exactly one of --old, --score-only, --baseline (got {modes or 'none'})", err=True)
        raise typer.Exit(2)
    if score_only is None and not attempt:
        typer.echo("error: --attempt is required with --old or --baseline", err=True)
        raise typer.Exit(2)
    try:
        settings = build_settings(None, config=config, resume=True, device=device, model=model)
        prior = canary.read_score(baseline) if baseline is not None else None
    except (RLJobLoadError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    ctx = canary.canary_context(settings)
    if score_only is not None:
        canary.write_score(score_only, canary.score_url(ctx, new, image=new_image))
        typer.echo(f"figures of {new_image or 'this trainer'} written to {score_only}", err=True)
        return
    if prior is not None:  # a trainer upgrade: the same engine replica, scored by the old and the new trainer
        new_figures = canary.score_url(ctx, new, image=new_image, prefill_url=new_prefill)
        result = canary.make_verdict(prior, new_figures, settings.job.spec.upgrade_policy, attempt=attempt)
    else:
        result = canary.engine_upgrade_verdict(
            ctx, old_url=str(old), new_url=new, old_image=old_image, new_image=new_image, attempt=attempt,
            old_prefill=old_prefill, new_prefill=new_prefill,
        )  # fmt: skip
    if not canary.publish(result):
        typer.echo("error: the verdict could not be written as the termination message", err=True)
        raise typer.Exit(1)
    typer.echo(f"canary {'passed' if result.passed else 'FAILED'}: {result.message}", err=True)
