"""The `r3operator` command line.

Exit codes (validate, render): 0 no errors; 1 a rule reported an error; 2 the input could not be
read as an RLJob (unreadable file, malformed YAML, not an RLJob, unknown field, wrong type).
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from r3operator.cli import output

app = typer.Typer(
    name="r3operator",
    help="Kubernetes operator for MoE RL post-training with Rollout Routing Replay (R3).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class OutputFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


FilesArg = Annotated[list[Path], typer.Argument(help="RLJob YAML files (multi-document files allowed).")]


@app.command()
def validate(
    files: FilesArg,
    output_format: Annotated[
        OutputFormat, typer.Option("--output", "-o", help="text or json")
    ] = OutputFormat.TEXT,
) -> None:
    """Check RLJobs against the schema and every compatibility rule."""
    from r3operator.cli.validate import validate_files

    results = validate_files(files)
    if output_format is OutputFormat.JSON:
        print(json.dumps([r.as_json() for r in results.rows], indent=2))
    else:
        output.print_validation(results)
    raise typer.Exit(results.exit_code)


@app.command()
def explain(file: Annotated[Path, typer.Argument(help="An RLJob YAML file.")]) -> None:
    """Print the resolved plan: GPUs, EP sizes, vLLM version and gated features, replay path."""
    from r3operator.api import RLJobLoadError, evaluate, load_rljob, plan
    from r3operator.api.rules import errors

    try:
        job = load_rljob(file)
    except RLJobLoadError as exc:
        output.print_load_error(exc)
        raise typer.Exit(2) from None
    findings = evaluate(job.spec)
    output.print_plan(job, plan(job), findings)
    raise typer.Exit(1 if errors(findings) else 0)


@app.command()
def crd() -> None:
    """Print the RLJob CustomResourceDefinition generated from the API models."""
    from r3operator.api.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())


@app.command()
def rules(markdown: Annotated[bool, typer.Option("--markdown", help="Print docs/rules.md")] = False) -> None:
    """List the compatibility rules: id, severity, where enforced, sources."""
    from r3operator.api.docs import rules_markdown
    from r3operator.api.rules import RULES

    if markdown:
        sys.stdout.write(rules_markdown())
        return
    for r in RULES:
        where = "CEL" if r.cel is not None else "operator"
        output.out.print(f"{r.id:<24} {r.severity.value:<8} {where:<9} {r.summary}", markup=False)


def _mount_optional() -> None:
    # Sub-apps live in their own modules so `r3operator validate` stays import-light.
    from r3operator.cli import observe_cmds, operator_cmds, routing, run_cmd
    from r3operator.cli.up import command as up_command

    app.add_typer(routing.app, name="routing")
    app.command("render")(operator_cmds.render)
    app.command("operator")(operator_cmds.run_operator)
    app.command("run")(run_cmd.run)
    app.command("up")(up_command.up)
    app.command("reference-model")(run_cmd.reference_model)
    app.command("upgrade-canary")(run_cmd.upgrade_canary)
    app.command("dashboard-preview")(observe_cmds.dashboard_preview)
    app.command("dashboards")(observe_cmds.dashboards)


_mount_optional()


def main() -> None:  # pragma: no cover - console entry point
    app()
