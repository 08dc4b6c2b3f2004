"""`r3operator` command line (placeholder until the API lands)."""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)
