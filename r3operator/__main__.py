"""`python -m r3operator ...` is the `r3operator` command, for an environment without the console script."""

from r3operator.cli.main import app

if __name__ == "__main__":
    app()
