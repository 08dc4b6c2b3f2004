"""Held-out evaluation (`spec.evaluation`, runtime/evaluation.py) through the driver on CPU: the real trainer (tiny
model) against the in-process fake engine, whose answers to the held-out prompts the tests script and then score
with a reward of their own."""

from __future__ import annotations

import csv
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine
from runtime_test_helpers import settings_for, write_job

from r3operator.models.tokenizer import BOS, EOS, vocabulary
from r3operator.routing.sample import RolloutSample

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
VOCAB = vocabulary(512)
INDEX = {token: i for i, token in enumerate(VOCAB)}
HELD_OUT = [(1, 2), (2, 3), (3, 3), (4, 1), (2, 2), (0, 5), (1, 1)]  # a + b; the file's first 5 rows are evaluated
GROUP, EVAL_N, MAX_PROMPTS = 4, 2, 5


def _ids(text: str) -> tuple[int, ...]:
    return tuple(INDEX[word] for word in text.split())


def _held_out_file(tmp_path: Path) -> Path:
    path = tmp_path / "held_out.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)}) + "\n" for a, b in HELD_OUT)
    )
    return path


# The held-out prompts as the engine must get them: the reference tokenizer's chat template, written out here.
EVAL_PROMPTS = [_ids(f"{BOS} user : what is {a} plus {b} ? assistant :") for a, b in HELD_OUT[:MAX_PROMPTS]]


def hand_reward(sample: RolloutSample, answer: int) -> float:
    """The test's own reward: 1 when the completion's last digit word is the answer."""
    digits = [VOCAB[t] for t in sample.token_ids if VOCAB[t].isdigit()]
    return float(bool(digits) and int(digits[-1]) == answer)


@dataclass
class Request:
    prompts: list[tuple[int, ...]]
    max_tokens: int
    temperature: float
    seed: int
    n: int
    starts: list[int] | None
    samples: list[RolloutSample]


@dataclass
class RecordingEngine(FakeEngine):
    """The fake engine, recording every generate request and its answers, and whether the engine gate (async mode)
    was paused and on which thread it ran."""

    requests: list[Request] = field(default_factory=list)
    gate: Any = None
    where: list[tuple[str, bool]] = field(default_factory=list)

    def generate(
        self,
        prompts: Any,
        *,
        max_tokens: int,
        temperature: float,
        seed: int,
        n: int,
        routed_experts_prompt_start: Any = None,
    ) -> list[RolloutSample]:
        self.where.append((threading.current_thread().name, self.gate is not None and self.gate._paused))
        samples = super().generate(
            prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            n=n,
            routed_experts_prompt_start=routed_experts_prompt_start,
        )
        starts = None if routed_experts_prompt_start is None else list(routed_experts_prompt_start)
        self.requests.append(Request([tuple(p) for p in prompts], max_tokens, temperature, seed, n, starts, samples))
        return samples


def scripted(engine: FakeEngine, training: dict[tuple[int, ...], str] | None = None) -> Any:
    """Answers to the held-out prompts that improve with every weight sync (row i is answered right once more than
    i syncs happened), the second sample of a few rows right too; a training prompt's first sample is its answer
    (`training`: prompt ids -> answer) and the others random tokens, so its group has advantages to train on."""
    rows = {prompt: (i, a + b) for i, (prompt, (a, b)) in enumerate(zip(EVAL_PROMPTS, HELD_OUT, strict=False))}

    def answer(prompt: tuple[int, ...], choice: int) -> list[int] | None:
        if prompt not in rows:
            known = (training or {}).get(prompt)
            return [INDEX[known], INDEX[EOS]] if known is not None and choice == 0 else None
        i, total = rows[prompt]
        syncs = engine.counts.get("finish", 0)
        if choice == 0:
            said = total if i < syncs else (total + 1) % 10
            return [*_ids(f"the answer is {said}"), INDEX[EOS]]
        return [*_ids(str(total) if i % 3 == 0 else "no"), INDEX[EOS]]

    return answer


def _run(tmp_path: Path, engine: FakeEngine, *, steps: int, evaluation: dict[str, Any] | None, **spec: Any) -> Any:
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.loop import GRPORun

    job = write_job(
        tmp_path,
        task={"name": "dataset", "datasetPath": str(ARITH), "reward": "math"},
        rollout={"promptsPerStep": 3, "groupSize": GROUP, "maxTokens": 8},
        weightSync={"canary": False},
        **({"evaluation": evaluation} if evaluation else {}),
        **spec,
    )
    return GRPORun(settings_for(job, tmp_path / "runs", steps=steps), engines=EngineGroup([engine]))


def test_the_eval_reward_is_the_tasks_reward_of_the_engines_answers_to_the_held_out_rows(tmp_path: Path) -> None:
    from r3operator.api.v1alpha1 import Progress
    from r3operator.runtime.metrics import eval_progress_patch, progress_patch
    from r3operator.runtime.progress import step_line
    from r3operator.runtime.report import REWARD_PANEL, plot_figure, read_eval_rows, read_rows, write_report

    engine = RecordingEngine()
    engine.answer = scripted(engine)
    evaluation = {
        "datasetPath": str(_held_out_file(tmp_path)),
        "intervalSteps": 2,
        "maxPrompts": MAX_PROMPTS,
        "samplesPerPrompt": EVAL_N,
        "temperature": 0.5,
    }
    run = _run(tmp_path, engine, steps=3, evaluation=evaluation)
    rows = run.run()

    # Before training (step 0), after step 2 (intervalSteps) and after the last step: the first 5 rows, templated,
    # n answers each, at the eval temperature, the rollout's maxTokens, one seed every time, routes from the last
    # prompt token on.
    evals = [r for r in engine.requests if r.n == EVAL_N]
    assert len(evals) == 3 and len(engine.requests) == 3 + 3  # and one rollout per step
    for request in evals:
        assert request.prompts == EVAL_PROMPTS
        assert (request.temperature, request.max_tokens, request.seed) == (0.5, 8, evals[0].seed)
        assert request.starts == [len(p) - 1 for p in EVAL_PROMPTS]
    assert all(r.seed != evals[0].seed for r in engine.requests if r.n == GROUP)
    answers = [a + b for a, b in HELD_OUT[:MAX_PROMPTS]]
    expected = [
        [hand_reward(s, answers[s.prompt_index]) for s in request.samples] for request in evals
    ]  # the engine's outputs, scored here
    means = [float(np.mean(e)) for e in expected]
    assert means[0] < means[1] < means[2]  # the scripted answers improve with the syncs: a figure per policy

    written = read_eval_rows(run.run_dir / "eval.csv")
    assert [int(r["step"]) for r in written] == [0, 2, 3]
    assert [int(r["policy_version"]) for r in written] == [1, 3, 4]
    for row, scores, request in zip(written, expected, evals, strict=True):
        assert float(row["eval_reward_mean"]) == pytest.approx(np.mean(scores))
        assert float(row["eval_reward_std"]) == pytest.approx(np.std(scores))
        assert (int(row["prompts"]), int(row["samples"])) == (MAX_PROMPTS, MAX_PROMPTS * EVAL_N)
        lengths = [len(s.token_ids) for s in request.samples]
        assert float(row["response_tokens_mean"]) == pytest.approx(np.mean(lengths))
        assert float(row["seconds"]) > 0

    # metrics.csv: eval_reward and t_eval on the steps that evaluated, empty cells elsewhere.
    with (run.run_dir / "metrics.csv").open() as fh:
        cells = list(csv.DictReader(fh))
    assert [c["eval_reward"] for c in cells] == ["", f"{means[1]}", f"{means[2]}"]
    assert cells[0]["t_eval"] == "" and all(float(c["t_eval"]) > 0 for c in cells[1:])
    assert rows[0].eval_reward is None and rows[2].eval_reward == pytest.approx(means[2])

    # Prometheus: the last evaluation's reward and step.
    exposition = run.metrics.exposition()
    labels = '{namespace="default",rljob="tiny-count-r3"}'
    assert f"r3operator_eval_reward{labels} {means[2]}" in exposition
    assert f"r3operator_eval_step{labels} 3.0" in exposition

    # status.progress: the figures with the step that evaluated, left out (so kept) on one that did not.
    status = progress_patch(rows[2], total_steps=3, last_checkpoint_step=3)["status"]["progress"]
    progress = Progress.model_validate(status)
    assert (progress.eval_reward, progress.eval_step) == (pytest.approx(means[2]), 3)
    quiet = progress_patch(rows[0], total_steps=3, last_checkpoint_step=1)["status"]["progress"]
    assert "evalReward" not in quiet and "evalStep" not in quiet
    assert eval_progress_patch(0, means[0]) == {"status": {"progress": {"evalReward": means[0], "evalStep": 0}}}

    # The progress line, the report and the plot.
    assert f"eval reward {means[1]:.3f}" in step_line(rows[1], 3) and "eval reward" not in step_line(rows[0], 3)
    text = write_report(
        tmp_path / "report.md",
        job_name="t",
        runs={"R3": read_rows(run.run_dir / "metrics.csv")},
        facts={},
        evals={"R3": written},
    )
    assert (
        f"- held-out eval reward ({MAX_PROMPTS} prompts × {EVAL_N}, 3 evaluations): {means[0]:.3f} before training → "
        f"{means[2]:.3f} after step 3 ({means[2] - means[0]:+.3f}); best {means[2]:.3f} after step 3"
    ) in text
    figure = plot_figure({"R3": read_rows(run.run_dir / "metrics.csv")}, {"R3": written})
    [reward_axes] = [ax for ax in figure.axes if ax.get_title() == REWARD_PANEL]
    [line] = [line for line in reward_axes.get_lines() if line.get_label() == "R3 held-out eval"]
    assert list(line.get_xdata()) == [0, 2, 3] and list(line.get_ydata()) == pytest.approx(means)


def test_a_run_with_evaluation_trains_exactly_the_samples_of_one_without(tmp_path: Path) -> None:
    """The reference is the same run without spec.evaluation, in this process: the same prompts, seeds and sampled
    tokens every step, and the same update (loss, gradient norm, the trainer's logprobs) — nothing of the evaluation
    is trained on."""
    runs = {}
    for name, evaluation in (
        ("without", None),
        ("with", {"datasetPath": str(_held_out_file(tmp_path)), "intervalSteps": 1, "samplesPerPrompt": EVAL_N}),
    ):
        engine = RecordingEngine()
        training: dict[tuple[int, ...], str] = {}
        engine.answer = scripted(engine, training)
        (tmp_path / name).mkdir()
        run = _run(tmp_path / name, engine, steps=2, evaluation=evaluation, algorithm={"sftWarmupSteps": 2})
        training.update({p.prompt_ids: p.answer for p in _rows(ARITH, run)})
        runs[name] = (run.run(), [r for r in engine.requests if r.n == GROUP], engine)
    (plain, plain_rollouts, _), (evaluated, rollouts, engine) = runs["without"], runs["with"]
    assert len([r for r in engine.requests if r.n == EVAL_N]) == 3  # step 0, 1, 2: the evaluation did run
    assert len(rollouts) == len(plain_rollouts) == 2
    for mine, reference in zip(rollouts, plain_rollouts, strict=True):
        assert (mine.prompts, mine.seed, mine.temperature) == (reference.prompts, reference.seed, reference.temperature)
        assert [s.token_ids for s in mine.samples] == [s.token_ids for s in reference.samples]
    for mine, reference in zip(evaluated, plain, strict=True):
        assert 0 < mine.reward_mean < 1 and mine.grad_norm > 0  # an update with something to learn
        for column in ("reward_mean", "samples", "tokens", "loss", "policy_version"):
            assert getattr(mine, column) == getattr(reference, column), column
        # The trainer's figures up to its own run-to-run noise on CPU (two identical runs differ by ~2e-4 relative;
        # one SFT step on an eval answer between steps moves them by 2-20 %).
        for column in ("logprob_abs_diff_mean", "kl_k3", "grad_norm"):
            assert getattr(mine, column) == pytest.approx(getattr(reference, column), rel=5e-3), column


def test_asynchronous_evaluations_run_inside_the_weight_syncs_pause(tmp_path: Path) -> None:
    """algorithm.mode async: the producer generates on its own thread; each due evaluation runs on the trainer's
    thread while the gate holds the producer paused (after the sync and canary), and is timed apart from the pause."""
    from r3operator.rollout.engines import EngineGroup
    from r3operator.runtime.async_loop import AsyncGRPORun

    job = write_job(
        tmp_path,
        task={"name": "dataset", "datasetPath": str(ARITH), "reward": "math"},
        rollout={"promptsPerStep": 2, "groupSize": 2, "maxTokens": 8, "partialRollout": True},
        algorithm={"mode": "async", "maxStaleness": 1},
        weightSync={"canary": False},
        evaluation={"datasetPath": str(_held_out_file(tmp_path)), "intervalSteps": 1, "samplesPerPrompt": 3},
    )
    engine = RecordingEngine()
    engine.answer = scripted(engine)
    run = AsyncGRPORun(settings_for(job, tmp_path / "runs", steps=2), engines=EngineGroup([engine]))
    engine.gate = run.gate
    trainer = threading.current_thread().name
    rows = run.run()

    calls = list(zip(engine.requests, engine.where, strict=True))
    evaluations = [(thread, paused) for request, (thread, paused) in calls if request.n == 3]
    # Step 0 runs in the set-up, before the producer starts; steps 1 and 2 inside the sync's pause.
    assert evaluations == [(trainer, False), (trainer, True), (trainer, True)]
    assert {thread for request, (thread, _) in calls if request.n == 1} == {"r3-rollout-producer"}
    for row in rows:
        assert row.phase_seconds["eval"] > 0 and row.phase_seconds["pause"] >= 0 and row.eval_reward is not None
    assert [int(r["step"]) for r in _eval_rows(run)] == [0, 1, 2]


def _rows(path: Path, run: Any) -> list[Any]:
    """The dataset's problems as the run will load them (its tokenizer's chat template), before its set-up."""
    from transformers import AutoTokenizer

    from r3operator.tasks.dataset_task import load_problems

    return list(load_problems(path, AutoTokenizer.from_pretrained(run.model_dir), max_prompt_tokens=None))


def _eval_rows(run: Any) -> list[dict[str, Any]]:
    from r3operator.runtime.report import read_eval_rows

    return read_eval_rows(run.run_dir / "eval.csv")


def test_a_malformed_eval_file_stops_the_run_at_setup_naming_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "held_out.jsonl"
    bad.write_text('{"prompt": "what is 1 plus 1 ?", "answer": "2"}\n{"prompt": "what is 2 plus 2 ?"}\n')
    engine = RecordingEngine()
    run = _run(tmp_path, engine, steps=1, evaluation={"datasetPath": str(bad)})
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}:2: missing 'answer'$"):
        run.setup()
    assert engine.calls == []  # refused before any engine was touched


def test_a_resumed_run_keeps_the_evaluations_through_its_checkpoint(tmp_path: Path) -> None:
    from r3operator.runtime.report import append_eval_row, keep_eval_rows_through, read_eval_rows

    path = tmp_path / "eval.csv"
    for step in (0, 2, 4):
        append_eval_row(
            path,
            {
                "step": step,
                "policy_version": step + 1,
                "eval_reward_mean": step / 10,
                "eval_reward_std": 0.0,
                "prompts": 5,
                "samples": 5,
                "response_tokens_mean": 3.0,
                "seconds": 0.1,
            },
        )
    with path.open("a") as fh:
        fh.write("6,7,0.9")  # a crash mid-append
    assert [int(r["step"]) for r in read_eval_rows(path)] == [0, 2, 4]
    keep_eval_rows_through(path, 3)  # resumed from the step-3 checkpoint: step 4 runs (and evaluates) again
    assert [(int(r["step"]), float(r["eval_reward_mean"])) for r in read_eval_rows(path)] == [(0, 0.0), (2, 0.2)]


def test_the_live_table_gets_an_eval_column_once_a_step_evaluated() -> None:
    from dataclasses import replace

    from records import step_record

    from r3operator.runtime.progress import StepTable

    row = step_record(1, reward_mean=0.5, logprob_abs_diff_mean=0.01, canary_ok=1, step_seconds=1.0)
    table = StepTable("t", total_steps=2, enabled=False)
    table.add(row)
    assert "eval reward" not in [c.header for c in table._table().columns]
    table.add(replace(row, step=2, eval_reward=0.375))
    rendered = table._table()
    [column] = [c for c in rendered.columns if c.header == "eval reward"]
    assert list(column.cells) == ["", "0.375"]


def test_the_defaults_follow_verl_but_sample_at_the_rollouts_temperature(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from r3operator.api import load_rljob
    from r3operator.models import ensure_reference_model
    from r3operator.runtime.evaluation import build_evaluation
    from r3operator.tasks.dataset_task import DatasetTask, load_problems
    from r3operator.tasks.rewards import MathReward

    held_out = _held_out_file(tmp_path)
    job = load_rljob(
        write_job(
            tmp_path,
            task={"name": "dataset", "datasetPath": str(ARITH), "reward": "math"},
            rollout={"temperature": 0.7, "maxTokens": 6},
            evaluation={"datasetPath": str(held_out)},
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(ensure_reference_model("tiny"))
    task = DatasetTask(
        load_problems(ARITH, tokenizer, max_prompt_tokens=None), tokenizer=tokenizer, reward=MathReward(), seed=0
    )
    evaluation = build_evaluation(job.spec, task, held_out, last_step=25, run_dir=tmp_path)
    assert evaluation is not None and evaluation.before_training  # verl's val_before_train
    assert [s for s in range(26) if evaluation.due(s)] == [10, 20, 25]  # test_freq 10, and the last step
    request = evaluation.request
    assert (request.temperature, request.n, request.max_tokens) == (0.7, 1, 6)  # rollout's temperature, n 1
    assert list(request.prompts) == [_ids(f"{BOS} user : what is {a} plus {b} ? assistant :") for a, b in HELD_OUT]
    assert (
        build_evaluation(job.spec.model_copy(update={"evaluation": None}), task, None, last_step=25, run_dir=tmp_path)
        is None
    )


def test_progress_says_the_trained_tokens_per_second_and_the_time_left() -> None:
    from dataclasses import replace

    from records import step_record

    from r3operator.runtime.progress import StepTable, duration, step_line

    first = step_record(1, tokens=1000, prompt_tokens=200, step_seconds=2.0, canary_ok=1, skipped=0)
    # (1000 + 200) tokens / 2 s; 9 steps left at 2 s.
    assert step_line(first, 10, eta=18.0).endswith("step 2.00s  tok/s 600  ETA 18s")
    table = StepTable("t", total_steps=10, enabled=False)
    table.add(first)
    table.add(replace(first, step=2, step_seconds=4.0))
    # 8 steps left at the mean of 2 s and 4 s.
    assert table._table().title == "t  (step 2/10  ETA 24s)"
    [column] = [c for c in table._table().columns if c.header == "tok/s"]
    assert list(column.cells) == ["600", "300"]
    assert [duration(s) for s in (44.6, 723, 3720)] == ["45s", "12m03s", "1h02m"]
