"""benchmarks/report_json.py: what every benchmark prints and writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.report_json import emit

RESULT = {"median_s": 0.166, "phases": {"finish": 0.0373}, "gpus": [1, 2]}


def test_the_json_is_printed_and_written_into_a_folder_it_makes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "new" / "folder" / "result.json"
    emit(RESULT, path)
    assert json.loads(capsys.readouterr().out) == RESULT
    assert json.loads(path.read_text()) == RESULT and path.read_text().endswith("\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["result.json"]  # no partial file left beside it


def test_a_benchmark_with_a_table_of_its_own_only_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "result.json"
    emit(RESULT, path, echo=False)
    assert capsys.readouterr().out == ""
    assert json.loads(path.read_text()) == RESULT


def test_a_rewrite_replaces_the_whole_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "result.json"
    path.write_text('{"a much longer earlier result": [' + "0, " * 1000 + "0]}\n")
    emit({"short": 1}, path)
    assert json.loads(path.read_text()) == {"short": 1}
