"""Rows of a dataset file (`spec.task.datasetPath`): JSONL or Parquet (pyarrow, in the runtime extra).

A row is one JSON object (one line of a `.jsonl` file) or one row of a `.parquet` file with:

- `prompt`: a non-empty string, or `messages`: a non-empty list of {"role": str, "content": str} (exactly
  one of the two);
- `answer`: a string (a number is taken as its decimal text): what the reward compares with;
- `solution` (optional): a non-empty string, the worked solution the supervised warm-up (`algorithm.sftWarmupSteps`)
  trains on instead of `answer`, e.g. the reasoning steps that end in the answer; the reward never reads it;
- `id` (optional): a string or an integer, unique in the file; default `row-<n>` (n counts rows from 0);
- any other column: kept as the row's metadata and handed to the reward (with `id`).

Blank lines of a JSONL file are skipped. A malformed row stops the read with a DatasetError naming the
file and the line (JSONL) or row (Parquet); nothing is skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Any: a dataset row is JSON or a Parquet record of the user's shape (pyarrow ships no types), checked field by field
# here: Any until checked.

PROMPT, MESSAGES, ANSWER, SOLUTION, ID = "prompt", "messages", "answer", "solution", "id"
SUFFIXES = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """The dataset file cannot be read or holds a malformed row; the message names the file and row."""


@dataclass(frozen=True)
class DatasetRow:
    where: str
    """`file:line` (JSONL) or `file row n` (Parquet), for messages."""
    id: str
    prompt: str | None
    messages: tuple[Mapping[str, str], ...] | None
    answer: str
    metadata: Mapping[str, Any]
    solution: str | None = None
    """The supervised warm-up's target, where the row has one (else the answer is)."""


def read_rows(path: Path) -> list[DatasetRow]:
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; expected one of {list(SUFFIXES)}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    records = _jsonl_records(path) if path.suffix == ".jsonl" else _parquet_records(path)
    rows: list[DatasetRow] = []
    first_seen: dict[str, str] = {}
    for where, record in records:
        row = parse_row(record, where=where, index=len(rows))
        if row.id in first_seen:
            raise DatasetError(f"{where}: id {row.id!r} repeats the row at {first_seen[row.id]}")
        first_seen[row.id] = where
        rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    return rows


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{path}:{number}: not a JSON object: {exc}") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow in the trainer image; install it, or convert the file to JSONL"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses for a corrupt file
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    for number, record in enumerate(table.to_pylist()):
        yield f"{path} row {number}", record


def parse_row(record: Any, *, where: str, index: int) -> DatasetRow:
    if not isinstance(record, dict):
        raise DatasetError(
            f"{where}: expected an object with {PROMPT!r} or {MESSAGES!r} and {ANSWER!r}, got {type(record).__name__}"
        )
    # A Parquet column missing from a row reads as None: treat it as absent.
    present = {key: value for key, value in record.items() if value is not None}
    has_prompt, has_messages = PROMPT in present, MESSAGES in present
    if has_prompt == has_messages:
        which = "both" if has_prompt else "neither"
        raise DatasetError(f"{where}: a row has {PROMPT!r} or {MESSAGES!r}, exactly one; this one has {which}")
    prompt = _prompt(present[PROMPT], where) if has_prompt else None
    messages = _messages(present[MESSAGES], where) if has_messages else None
    if ANSWER not in present:
        raise DatasetError(f"{where}: missing {ANSWER!r}")
    answer = _text(present[ANSWER], where, ANSWER)
    solution = _solution(present[SOLUTION], where) if SOLUTION in present else None
    row_id = _text(present[ID], where, ID) if ID in present else f"row-{index}"
    metadata = {key: value for key, value in present.items() if key not in (PROMPT, MESSAGES, ANSWER, SOLUTION)}
    metadata[ID] = row_id
    return DatasetRow(
        where=where,
        id=row_id,
        prompt=prompt,
        messages=messages,
        answer=answer,
        metadata=metadata,
        solution=solution,
    )


def _text(value: Any, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"{where}: {field!r} must be a string, got {type(value).__name__} {value!r}")


def _solution(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: {SOLUTION!r} must be a non-empty string (the warm-up's target), got {value!r}")
    return value


def _prompt(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: {PROMPT!r} must be a non-empty string, got {value!r}")
    return value


def _messages(value: Any, where: str) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: {MESSAGES!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for n, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: {MESSAGES}[{n}] must be an object with string 'role' and 'content', got {message!r}"
            )
        out.append({"role": message["role"], "content": message["content"]})
    return tuple(out)
