"""The generated `arith-chain` task: its solutions add up, its splits never share a problem, its files are the same
bytes on every run, every word is in the reference tokenizer, and its reward reads the final answer the way the
reference tokenizer decodes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from r3operator.tasks.arith_chain import ChainSpec, final_answer, rows, score, write_splits

SMALL = ChainSpec(train_rows=400, eval_rows=64, max_terms=12)


def _terms(prompt: str) -> list[int]:
    assert prompt.startswith("add ")
    return [int(t) for t in prompt.removeprefix("add ").split(" + ")]


def test_every_solution_adds_its_terms_one_at_a_time() -> None:
    for row in rows(SMALL, split="train")[:200]:
        terms = _terms(row["prompt"])
        assert SMALL.min_terms <= len(terms) == row["terms"] <= SMALL.max_terms
        assert int(row["answer"]) == sum(terms)
        lines = row["solution"].split(" . answer : ")
        assert lines[1] == row["answer"]
        running = terms[0]
        steps = lines[0].split(" , ")
        assert len(steps) == len(terms) - 1
        for term, step in zip(terms[1:], steps, strict=True):
            a, b, c = (int(x) for x in re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", step).groups())  # type: ignore[union-attr]
            assert (a, b, c) == (running, term, running + term)
            running += term


def test_the_splits_share_no_problem() -> None:
    train = {r["prompt"] for r in rows(SMALL, split="train")}
    held = {r["prompt"] for r in rows(SMALL, split="eval")}
    assert len(train) == SMALL.train_rows and len(held) == SMALL.eval_rows
    assert not train & held
    # Membership is a property of the problem, not of the draw: a bigger train split still holds none of them.
    bigger = {r["prompt"] for r in rows(ChainSpec(train_rows=4000, eval_rows=64, max_terms=12), split="train")}
    assert len(bigger) == 4000
    assert not bigger & held


def test_the_files_are_the_same_bytes_every_time(tmp_path: Path) -> None:
    first = write_splits(tmp_path / "a", SMALL)
    second = write_splits(tmp_path / "b", SMALL)
    for split in ("train", "eval"):
        assert first[split].read_bytes() == second[split].read_bytes()
        assert [json.loads(line)["id"] for line in first[split].read_text().splitlines()][:2] == [
            f"{split}-0",
            f"{split}-1",
        ]
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("3 7 + 5 = 4 2 . answer : 4 2", "42"),  # the reference tokenizer's decode: digits apart
        ("37 + 5 = 42 . answer : 42", "42"),
        ("3 + 4 = 7 . answer : 7 ", "7"),
        ("3 + 4 = 7 . answer : 7 . answer : 8", "8"),  # the last answer counts
        ("3 + 4 = 7", None),  # no answer
        ("answer : 7 then 8", None),  # an answer that is not the end of the completion
    ],
)
def test_the_final_answer_is_the_digits_after_the_last_answer_marker(completion: str, expected: str | None) -> None:
    assert final_answer(completion) == expected


def test_the_reward_is_one_only_for_the_right_final_answer() -> None:
    assert score("add 37 + 5", "3 7 + 5 = 4 2 . answer : 4 2", "42", {}) == 1.0
    assert score("add 37 + 5", "3 7 + 5 = 4 3 . answer : 4 3", "42", {}) == 0.0
    assert score("add 37 + 5", "3 7 + 5 = 4 2", "42", {}) == 0.0
    # The steps are not graded: a wrong step with the right final answer still scores.
    assert score("add 37 + 5", "3 7 + 5 = 4 1 . answer : 4 2", "42", {}) == 1.0


@pytest.mark.slow
def test_every_word_is_in_the_reference_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from r3operator.models.reference import ensure_reference_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_reference_model("tiny", tmp_path))
    for row in rows(SMALL, split="eval")[:32]:
        for text in (row["prompt"], row["solution"]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids, text
            # What the engine's completion decodes to scores 1 against the row's own answer.
        decoded = tokenizer.decode(tokenizer(row["solution"], add_special_tokens=False)["input_ids"])
        assert score(row["prompt"], decoded, row["answer"], {}) == 1.0


def test_a_split_larger_than_its_problems_is_refused() -> None:
    with pytest.raises(ValueError, match="raise max_terms"):
        ChainSpec(min_terms=2, max_terms=2, train_rows=100, eval_rows=10)


def test_the_cli_writes_both_splits_and_refuses_an_unknown_task(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from r3operator.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["tasks", "generate", "arith-chain", str(tmp_path), "--train-rows", "50"])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 50
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 512
    refused = runner.invoke(app, ["tasks", "generate", "sort", str(tmp_path)])
    assert refused.exit_code == 2 and "unknown task 'sort'" in refused.output
