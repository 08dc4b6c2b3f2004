"""`task.name: dataset`: prompts from a dataset file, tokenised once, scored by a declared text reward.

Tokenisation happens at load, once per row: the row's messages (a `prompt` row is one user message) go
through the tokenizer's chat template with the generation prompt, and the rendered text is encoded
WITHOUT the tokenizer's own special tokens (the template already wrote them; encoding with them would
put a second <bos> in front). From then on only token ids move: the engines get the ids, the trainer
trains on the engines' ids, and the reward decodes the completion's ids to text. Nothing is encoded
again, so the routes the engine returned stay on the tokens they were computed for. A tokenizer without
a chat template encodes a `prompt` row as plain text with its special tokens, and refuses `messages` rows.

The supervised warm-up trains on a row's `solution` where it has one (a worked solution ending in the answer),
else on its `answer` (`DatasetProblem.target_ids`); the reward compares with `answer` either way. The weight-sync
canary decodes as many tokens as the longest target, at most CANARY_MAX_TOKENS.

Prompts longer than `max_prompt_tokens` are dropped at load with one warning that counts them and names
the first few rows: a prompt the engine cannot fit beside `rollout.maxTokens` would fail the step, and
one long row should not end a run over a large file. A file left with no prompt is an error.

Order: epoch e is the permutation `default_rng([seed, e])` of the rows; step s (from 1) takes the next
`count` rows of epoch 0, then epoch 1, ... So every row is seen once per epoch, and a step's prompts depend
only on (seed, step): a resumed run sees what an uninterrupted one would have.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from r3operator.routing.sample import RolloutSample
from r3operator.tasks.dataset_reader import DatasetError, DatasetRow, read_rows
from r3operator.tasks.reward_base import RewardInput
from r3operator.tasks.rewards import TextReward
from r3operator.tasks.toy import Problem

log = logging.getLogger(__name__)
CANARY_PROMPTS = 4  # as for the built-in tasks: the first rows of the file
CANARY_MAX_TOKENS = 16  # a long reference solution would make every weight-sync canary decode that long
DROPPED_NAMED = 5  # rows named in the over-length warning


@dataclass(frozen=True)
class DatasetProblem(Problem):
    problem_id: str = ""
    prompt_text: str = ""
    """What the reward gets as `prompt`: the row's prompt, or its last message's content."""
    answer: str = ""
    metadata: Mapping[str, Any] | None = None
    solution_ids: tuple[int, ...] | None = None
    """The row's `solution`, tokenised with <eos> appended; None: the row has none."""

    @property
    def target_ids(self) -> tuple[int, ...]:
        """The supervised warm-up's target: the worked solution where the row has one, else the answer. The reward
        compares the decoded completion with `answer` either way."""
        return self.answer_ids if self.solution_ids is None else self.solution_ids


def encode_prompt(row: DatasetRow, tokenizer: Any) -> list[int]:
    """The row's prompt ids: the chat template applied once, never a second set of special tokens."""
    if getattr(tokenizer, "chat_template", None):
        messages = [dict(m) for m in row.messages] if row.messages else [{"role": "user", "content": row.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if row.messages:
        raise DatasetError(
            f"{row.where}: 'messages' need a tokenizer with a chat_template, and the model's has none; "
            "give plain 'prompt' rows"
        )
    return list(tokenizer(row.prompt)["input_ids"])


def load_problems(path: Path, tokenizer: Any, *, max_prompt_tokens: int | None) -> list[DatasetProblem]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DatasetError(f"{path}: the model's tokenizer has no eos_token; a completion could never end")
    problems, too_long = [], []
    for row in read_rows(path):
        prompt_ids = encode_prompt(row, tokenizer)
        if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
            too_long.append(f"{row.where} ({len(prompt_ids)} tokens)")
            continue
        # The warm-up trains on the solution's ids where the row has one, else the answer's; they also size the
        # canary. Rewards compare text with the answer.
        answer_ids = [*tokenizer(row.answer, add_special_tokens=False)["input_ids"], eos]
        solution_ids = None
        if row.solution is not None:
            solution_ids = (*tokenizer(row.solution, add_special_tokens=False)["input_ids"], eos)
        prompt_text = row.prompt if row.prompt is not None else row.messages[-1]["content"]  # type: ignore[index]
        problems.append(
            DatasetProblem(
                prompt_ids=tuple(prompt_ids),
                answer_ids=tuple(answer_ids),
                problem_id=row.id,
                prompt_text=prompt_text,
                answer=row.answer,
                metadata=row.metadata,
                solution_ids=solution_ids,
            )
        )
    if too_long:
        log.warning(
            "%s: dropped %d of %d prompts longer than %d tokens: %s%s",
            path,
            len(too_long),
            len(too_long) + len(problems),
            max_prompt_tokens,
            ", ".join(too_long[:DROPPED_NAMED]),
            ", ..." if len(too_long) > DROPPED_NAMED else "",
        )
    if not problems:
        raise DatasetError(
            f"{path}: every prompt is longer than {max_prompt_tokens} tokens "
            "(spec.task.maxPromptTokens, or inference.maxModelLen - rollout.maxTokens)"
        )
    return problems


@lru_cache(maxsize=4)
def _epoch_permutation(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.random.default_rng([seed, epoch]).permutation(size))


def step_indices(size: int, *, seed: int, step: int, count: int) -> list[int]:
    """The pool indices of step `step` (1-based): the next `count` rows of the seeded epoch permutations."""
    first = (step - 1) * count
    out = []
    for k in range(first, first + count):
        epoch, position = divmod(k, size)
        out.append(_epoch_permutation(size, seed, epoch)[position])
    return out


class DatasetTask:
    """The dataset task's problems, their order and their reward."""

    def __init__(self, problems: Sequence[DatasetProblem], *, tokenizer: Any, reward: TextReward, seed: int) -> None:
        self.pool: list[DatasetProblem] = list(problems)
        self.tokenizer = tokenizer
        self.reward = reward
        self.seed = seed
        self.canary_prompts = [p.prompt_ids for p in self.pool[:CANARY_PROMPTS]]
        # The canary decodes as far as what the warm-up taught the model to write (a worked solution can be
        # long), capped: every weight sync pays for it.
        self.canary_tokens = min(CANARY_MAX_TOKENS, max(len(p.target_ids) for p in self.pool))

    def batch(self, step: int, count: int) -> list[DatasetProblem]:
        return [self.pool[i] for i in step_indices(len(self.pool), seed=self.seed, step=step, count=count)]

    def score(self, samples: Sequence[RolloutSample], problems: Sequence[Problem]) -> np.ndarray:
        inputs = []
        for sample in samples:
            problem = problems[sample.prompt_index]
            assert isinstance(problem, DatasetProblem)
            inputs.append(
                RewardInput(
                    sample_id=sample.sample_id,
                    prompt=problem.prompt_text,
                    completion=self.tokenizer.decode(list(sample.token_ids), skip_special_tokens=True),
                    answer=problem.answer,
                    metadata=problem.metadata or {},
                )
            )
        return np.asarray(self.reward.score(inputs), dtype=np.float32)
