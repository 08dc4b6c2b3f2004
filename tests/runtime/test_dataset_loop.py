"""`task.name: dataset` through the driver (`GRPORun.setup` → two steps), on CPU: the real trainer (tiny model)
against the in-process fake engine, which answers each prompt's first sample correctly and the rest at random."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job

from r3operator.models.tokenizer import BOS, EOS, vocabulary

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
INDEX = {token: i for i, token in enumerate(vocabulary(512))}
GROUP = 4


def _ids(text: str) -> tuple[int, ...]:
    return tuple(INDEX[word] for word in text.split())


def _run(tmp_path: Path, engine: FakeEngine, **task: Any) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    job = write_job(
        tmp_path,
        task={"name": "dataset", "datasetPath": str(ARITH), "reward": "math", **task},
        rollout={"promptsPerStep": 3, "groupSize": GROUP},
        weightSync={"canary": False},
    )
    return GRPORun(settings_for(job, tmp_path / "runs", steps=2), engines=EngineGroup([engine]))


def test_dataset_task_trains_two_steps_on_its_chat_prompts_with_the_math_reward(tmp_path: Path) -> None:
    answers: dict[tuple[int, ...], str] = {}

    def answer(prompt: tuple[int, ...], choice: int) -> list[int] | None:
        return [INDEX[answers[prompt]], INDEX[EOS]] if choice == 0 else None

    engine = FakeEngine(answer=answer)
    run = _run(tmp_path, engine)
    run.setup()
    answers.update({p.prompt_ids: p.answer for p in run.pool})
    assert len(run.pool) == 45  # every row of examples/data/arith.jsonl fits
    assert run.pool[0].prompt_ids == _ids(f"{BOS} user : what is 0 plus 0 ? assistant :")
    rows = [run.train_step(1), run.train_step(2)]

    # The engine got the chat-templated prompts of the dataset, 3 distinct rows per step, none repeated.
    prompts = engine.prompts_seen
    assert len(prompts) == 6 and len(set(prompts)) == 6 and set(prompts) <= set(answers)
    # Choice 0 is right (1), the others random tokens (0): the reward is the math reward's, not a stand-in.
    for row in rows:
        assert row.samples == 3 * GROUP and row.skipped == 0
        assert row.reward_mean == pytest.approx(1 / GROUP)
    with (run.run_dir / "metrics.csv").open() as fh:
        assert [r["step"] for r in csv.DictReader(fh)] == ["1", "2"]


def test_dataset_task_stops_at_setup_naming_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "what is 1 plus 1 ?", "answer": "2"}\n{"prompt": "what is 2 plus 2 ?"}\n')
    engine = FakeEngine()
    run = _run(tmp_path, engine, datasetPath=str(bad))
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}:2: missing 'answer'$"):
        run.setup()
    assert engine.calls == []  # refused before any engine was touched


def test_dataset_path_from_the_environment_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3operator.runtime.dataset_file import resolve_dataset_file

    run = _run(tmp_path, FakeEngine(), datasetPath="hdfs://bucket/math.jsonl")
    with pytest.raises(ValueError, match=r"fetches s3:// and gs://, not hdfs://; .* or set R3OPERATOR_DATASET_PATH"):
        resolve_dataset_file(run.s.job)
    monkeypatch.setenv("R3OPERATOR_DATASET_PATH", str(ARITH))
    assert resolve_dataset_file(run.s.job) == ARITH
