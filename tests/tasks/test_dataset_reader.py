"""Dataset rows from JSONL and Parquet; a malformed row is refused naming its file and line or row."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from r3operator.tasks.dataset_reader import DatasetError, read_rows


def _jsonl(tmp_path: Path, *lines: Any, name: str = "train.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_rows_keep_prompt_messages_answer_id_and_metadata(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        {"id": "a", "prompt": "what is 3 plus 4 ?", "answer": "7", "level": 1},
        "",  # blank lines are skipped
        {"messages": [{"role": "user", "content": "what is 2 times 3 ?"}], "answer": 6},
    )
    first, second = read_rows(path)
    assert (first.id, first.prompt, first.messages, first.answer) == ("a", "what is 3 plus 4 ?", None, "7")
    assert first.metadata == {"id": "a", "level": 1}
    assert first.where == f"{path}:1"
    assert second.id == "row-1" and second.prompt is None and second.answer == "6"
    assert second.messages == ({"role": "user", "content": "what is 2 times 3 ?"},)
    assert second.where == f"{path}:3"


def test_a_solution_is_kept_apart_from_the_answer_and_the_metadata(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        {"prompt": "what is 3 plus 4 ?", "answer": "7", "solution": "3 plus 4 is 7", "level": 1},
        {"prompt": "what is 2 plus 2 ?", "answer": "4"},
    )
    with_solution, without = read_rows(path)
    assert (with_solution.answer, with_solution.solution) == ("7", "3 plus 4 is 7")
    assert with_solution.metadata == {"id": "row-0", "level": 1}  # the reward gets the answer, not the solution
    assert without.solution is None


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not a JSON object"),
        ('["a list"]', "expected an object"),
        ({"answer": "1"}, "exactly one; this one has neither"),
        ({"prompt": "p", "messages": [{"role": "user", "content": "p"}], "answer": "1"}, "this one has both"),
        ({"prompt": "  ", "answer": "1"}, "'prompt' must be a non-empty string"),
        ({"prompt": "p"}, "missing 'answer'"),
        ({"prompt": "p", "answer": ["1"]}, "'answer' must be a string, got list"),
        ({"prompt": "p", "answer": True}, "'answer' must be a string, got bool"),
        ({"messages": [], "answer": "1"}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}], "answer": "1"}, "messages[0] must be an object with string 'role'"),
        ({"id": "ok-1", "prompt": "p", "answer": "1"}, "id 'ok-1' repeats the row at"),
        ({"prompt": "p", "answer": "1", "solution": ""}, "'solution' must be a non-empty string"),
        ({"prompt": "p", "answer": "1", "solution": 1}, "'solution' must be a non-empty string"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path: Path, bad_line: Any, message: str) -> None:
    path = _jsonl(tmp_path, {"id": "ok-1", "prompt": "what is 1 plus 1 ?", "answer": "2"}, bad_line)
    with pytest.raises(DatasetError) as err:
        read_rows(path)
    assert str(err.value).startswith(f"{path}:2: ")
    assert message in str(err.value)


def test_unknown_format_missing_and_empty_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"unknown dataset format '\.csv'"):
        read_rows(tmp_path / "train.csv")
    with pytest.raises(DatasetError, match="no such file"):
        read_rows(tmp_path / "absent.jsonl")
    with pytest.raises(DatasetError, match="has no rows"):
        read_rows(_jsonl(tmp_path, "", ""))


def test_parquet_rows_and_a_malformed_row_named_by_its_number(tmp_path: Path) -> None:
    # A dependency of the runtime extra (pyproject.toml): missing, this fails rather than skips.
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "train.parquet"
    pq.write_table(
        pa.table({"prompt": ["what is 3 plus 4 ?", "what is 2 times 3 ?"], "answer": ["7", "6"], "source": ["a", "b"]}),
        good,
    )
    rows = read_rows(good)
    assert [(r.id, r.prompt, r.answer, r.metadata["source"]) for r in rows] == [
        ("row-0", "what is 3 plus 4 ?", "7", "a"),
        ("row-1", "what is 2 times 3 ?", "6", "b"),
    ]
    assert rows[1].where == f"{good} row 1"

    chat = tmp_path / "chat.parquet"
    messages = [[{"role": "user", "content": "what is 1 plus 1 ?"}], [{"role": "user", "content": "hi"}]]
    pq.write_table(pa.table({"messages": messages, "answer": ["2", None]}), chat)
    with pytest.raises(DatasetError) as err:
        read_rows(chat)
    assert str(err.value) == f"{chat} row 1: missing 'answer'"


def test_parquet_without_pyarrow_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` raises ImportError
    with pytest.raises(DatasetError, match="reading Parquet needs pyarrow in the trainer image"):
        read_rows(path)
