"""The project's generated task datasets as files (`r3operator tasks generate`): the CLI's way to the tasks layer."""

from __future__ import annotations

from pathlib import Path

from r3operator.tasks import arith_chain

GENERATED = (arith_chain.NAME,)


def generate(
    name: str, directory: Path, *, max_terms: int, max_value: int, train_rows: int, eval_rows: int, seed: int
) -> dict[str, Path]:
    """Write task `name`'s train and held-out eval splits into `directory`; ValueError naming what is wrong."""
    if name != arith_chain.NAME:
        raise ValueError(f"unknown task {name!r}; choose one of {list(GENERATED)}")
    spec = arith_chain.ChainSpec(
        max_terms=max_terms, max_value=max_value, train_rows=train_rows, eval_rows=eval_rows, seed=seed
    )
    return arith_chain.write_splits(directory, spec)
