"""Where the driver's prompts and rewards come from: a built-in task or a dataset (`spec.task`).

The driver needs the same five things of either: the problem pool (the supervised warm-up samples it),
a step's problems (deterministic in seed and step), the rewards of a step's samples, and the canary's
prompts and length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from r3operator.api.checks import DATASET_TASK
from r3operator.api.v1alpha1 import RLJobSpec
from r3operator.routing.sample import RolloutSample
from r3operator.tasks import toy as tasks

CANARY_PROMPTS = 4


class TaskSource(Protocol):
    @property
    def pool(self) -> Sequence[tasks.Problem]: ...

    canary_prompts: list[tuple[int, ...]]
    canary_tokens: int

    def batch(self, step: int, count: int) -> Sequence[tasks.Problem]: ...

    def score(self, samples: Sequence[RolloutSample], problems: Sequence[tasks.Problem]) -> np.ndarray: ...


class BuiltinTask:
    """`count`, `next`, `guess`: token-id problems, drawn with replacement per (seed, step), token-id rewards."""

    def __init__(self, name: str, *, vocab_size: int, reward: str, seed: int) -> None:
        self.pool = tasks.problems(name, vocab_size=vocab_size)
        self.reward = reward
        self.seed = seed
        self.canary_prompts = [p.prompt_ids for p in self.pool[:CANARY_PROMPTS]]
        self.canary_tokens = tasks.max_answer_tokens(name, vocab_size=vocab_size)

    def batch(self, step: int, count: int) -> list[tasks.Problem]:
        return tasks.sample_problems(self.pool, count=count, rng=np.random.default_rng([self.seed, step]))

    def score(self, samples: Sequence[RolloutSample], problems: Sequence[tasks.Problem]) -> np.ndarray:
        return np.asarray(
            [tasks.reward(s.token_ids, problems[s.prompt_index].answer_ids, kind=self.reward) for s in samples],
            dtype=np.float32,
        )


def max_prompt_tokens(spec: RLJobSpec) -> int | None:
    """spec.task.maxPromptTokens, else what inference.maxModelLen leaves beside rollout.maxTokens."""
    if spec.task.max_prompt_tokens is not None:
        return spec.task.max_prompt_tokens
    if spec.inference.max_model_len is not None:
        return max(1, spec.inference.max_model_len - spec.rollout.max_tokens)
    return None


def build_task_source(spec: RLJobSpec, *, model_dir: Path, vocab_size: int, dataset_file: Path | None) -> TaskSource:
    if spec.task.name != DATASET_TASK:
        return BuiltinTask(spec.task.name, vocab_size=vocab_size, reward=spec.task.reward, seed=spec.seed)
    if dataset_file is None:
        raise ValueError("spec.task.datasetPath: task.name dataset needs a dataset file")
    from transformers import AutoTokenizer

    from r3operator.tasks.dataset_task import DatasetTask, load_problems
    from r3operator.tasks.rewards import build_reward

    reward = build_reward(spec.task)  # before the file is read: a missing reward function fails at once
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    problems = load_problems(dataset_file, tokenizer, max_prompt_tokens=max_prompt_tokens(spec))
    return DatasetTask(problems, tokenizer=tokenizer, reward=reward, seed=spec.seed)
