"""The `r3operator` command line.

Exit codes (validate, explain, render): 0 no errors; 1 a rule reported an error; 2 the input could not
be read as an RLJob (unreadable file, malformed YAML or a key given twice, not an RLJob, unknown field,
wrong type).
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from r3operator.cli import output
from r3operator.cli.cluster_facts import LeaderWorkerSetOption

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
    YAML = "yaml"


FilesArg = Annotated[
    list[Path], typer.Argument(help="RLJob YAML files (multi-document files allowed); - reads standard input.")
]
OutputOption = Annotated[OutputFormat, typer.Option("--output", "-o", help="text, json or yaml")]


def _print_data(data: object, output_format: OutputFormat) -> None:
    if output_format is OutputFormat.JSON:
        print(json.dumps(data, indent=2))
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def _print_version(value: bool) -> None:
    if value:
        from r3operator import __version__

        print(f"r3operator {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Kubernetes operator for MoE RL post-training with Rollout Routing Replay (R3)."""


@app.command()
def validate(
    files: FilesArg, output_format: OutputOption = OutputFormat.TEXT, leader_worker_set: LeaderWorkerSetOption = None
) -> None:
    """Check RLJobs against the schema and every compatibility rule."""
    from r3operator.cli.validate import validate_files

    results = validate_files(files, leader_worker_set=leader_worker_set)
    if output_format is OutputFormat.TEXT:
        output.print_validation(results)
    else:
        _print_data([r.as_json() for r in results.rows], output_format)
    raise typer.Exit(results.exit_code)


@app.command()
def explain(
    file: Annotated[
        Path, typer.Argument(help="An RLJob YAML file (multi-document files allowed); - reads standard input.")
    ],
    output_format: OutputOption = OutputFormat.TEXT,
    leader_worker_set: LeaderWorkerSetOption = None,
) -> None:
    """Print the resolved plan of each RLJob: GPUs, EP sizes, vLLM version, replay path, and the vLLM
    routed-experts feature gates when replay needs them (R3); in text, also the scheduling picture (per role:
    pods x GPUs, node selectors, tolerations, priority; the queue; the model). json/yaml print a list, one
    entry per RLJob."""
    from r3operator.api import RLJobLoadError, evaluate, load_rljobs, plan
    from r3operator.api.rules import errors
    from r3operator.cli.cluster_facts import rule_context
    from r3operator.cli.explain import plan_json
    from r3operator.operator.picture import scheduling_picture

    try:
        jobs = load_rljobs(file)
    except RLJobLoadError as exc:
        output.print_load_error(exc)
        raise typer.Exit(2) from None
    planned = [(job, plan(job), evaluate(job.spec, context=rule_context(job.spec, leader_worker_set))) for job in jobs]
    if output_format is OutputFormat.TEXT:
        for job, job_plan, findings in planned:
            output.print_plan(job, job_plan, findings)
            output.print_scheduling(scheduling_picture(job))
    else:
        _print_data([plan_json(str(file), *entry) for entry in planned], output_format)
    raise typer.Exit(1 if any(errors(findings) for _, _, findings in planned) else 0)


@app.command()
def crd() -> None:
    """Print the RLJob CustomResourceDefinition generated from the API models."""
    from r3operator.api.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())


@app.command()
def rules(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print docs/rules.md")] = False,
    output_format: OutputOption = OutputFormat.TEXT,
) -> None:
    """List the compatibility rules: id, severity, where enforced, sources."""
    from r3operator.api.docs import rules_markdown
    from r3operator.api.rules import RULES

    if markdown:
        sys.stdout.write(rules_markdown())
        return
    if output_format is not OutputFormat.TEXT:
        rows = [
            {
                "id": r.id,
                "severity": r.severity.value,
                "field": r.field,
                "reads": list(r.reads),
                "enforcedBy": ["operator", "CEL"] if r.cel is not None else ["operator"],
                "summary": r.summary,
                "sources": list(r.sources),
            }
            for r in RULES
        ]
        _print_data(rows, output_format)
        return
    for r in RULES:
        where = "CEL" if r.cel is not None else "operator"
        output.out.print(f"{r.id:<24} {r.severity.value:<8} {where:<9} {r.summary}", markup=False)


def _mount_optional() -> None:
    # Sub-apps live in their own modules so `r3operator validate` stays import-light.
    from r3operator.cli import fetch_cmd, observe_cmds, operator_cmds, routing, run_cmd, tasks_cmd
    from r3operator.cli.up import command as up_command

    app.add_typer(routing.app, name="routing")
    app.add_typer(tasks_cmd.app, name="tasks")
    app.command("render")(operator_cmds.render)
    app.command("operator")(operator_cmds.run_operator)
    app.command("run")(run_cmd.run)
    app.command("up")(up_command.up)
    app.command("reference-model")(run_cmd.reference_model)
    app.command("upgrade-canary")(run_cmd.upgrade_canary)
    app.command("fetch")(fetch_cmd.fetch)
    app.command("dashboard-preview")(observe_cmds.dashboard_preview)
    app.command("dashboards")(observe_cmds.dashboards)


_mount_optional()


def main() -> None:  # pragma: no cover - console entry point
    app()
