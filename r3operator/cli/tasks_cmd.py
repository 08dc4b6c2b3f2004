"""``r3operator tasks``: the project's generated datasets, written as files a `task.name: dataset` job reads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Generate the project's task datasets.", no_args_is_help=True, add_completion=False)


@app.command()
def generate(
    name: Annotated[str, typer.Argument(help="The task: arith-chain.")],
    directory: Annotated[Path, typer.Argument(help="Written: DIRECTORY/train.jsonl and DIRECTORY/eval.jsonl.")],
    max_terms: Annotated[int, typer.Option(min=2, help="At most this many numbers to add per problem.")] = 32,
    max_value: Annotated[int, typer.Option(min=2, help="The numbers are 1 to this.")] = 9,
    train_rows: Annotated[int, typer.Option(min=1)] = 20_000,
    eval_rows: Annotated[int, typer.Option(min=1)] = 512,
    seed: Annotated[int, typer.Option(min=0)] = 0,
) -> None:
    """Write a task's train and held-out eval splits (the same bytes for the same options, everywhere)."""
    from r3operator.runtime.task_files import generate as write

    try:
        paths = write(
            name,
            directory,
            max_terms=max_terms,
            max_value=max_value,
            train_rows=train_rows,
            eval_rows=eval_rows,
            seed=seed,
        )
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    for split, path in paths.items():
        typer.echo(f"{split}: {path}")
