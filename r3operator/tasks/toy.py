"""Verifiable toy tasks over the reference tokenizer, with rule-based rewards.

Prompts and answers are token ids built from the reference vocabulary (`r3operator.models.tokenizer`),
so no tokenizer round trip sits between the reward and what the engine generated.

- `count`: "<bos> count from 3 to 6 :" -> "3 4 5 6 <eos>" (2-4 numbers; a random-init model cannot
  do it, a few supervised warm-up steps make it partially right, RL then raises the reward);
- `next`:  "<bos> Q : next number after 4 ? A :" -> "5 <eos>";
- `guess`: the multi-turn guessing game of `tasks/envs.py` ("<bos> Q : what number from 0 to 9 ? A :",
  a secret digit per problem). Its answer "7 <eos>" is the format the supervised warm-up teaches; the
  reward comes from the environment at the end of the conversation, not from `reward` below.

Rewards: `exact-match` (1 if the completion up to and including <eos> equals the answer) and
`prefix-match` (fraction of answer tokens matched before the first mistake; smoother for tiny models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from r3operator.models.tokenizer import BOS, EOS, vocabulary

TASKS = ("count", "next", "guess")
GUESS_PROMPT = (BOS, "Q", ":", "what", "number", "from", "0", "to", "9", "?", "A", ":")
REWARDS = ("exact-match", "prefix-match")


@dataclass(frozen=True)
class Problem:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # ends with <eos>

    @property
    def target_ids(self) -> tuple[int, ...]:
        """What the supervised warm-up trains the completion on (ends with <eos>): the answer."""
        return self.answer_ids


@cache
def _vocab_index(vocab_size: int) -> dict[str, int]:
    return {tok: i for i, tok in enumerate(vocabulary(vocab_size))}


def _ids(words: Sequence[str], vocab_size: int) -> tuple[int, ...]:
    index = _vocab_index(vocab_size)
    return tuple(index[w] for w in words)


def problems(task: str, *, vocab_size: int) -> list[Problem]:
    """Every problem of `task`, in a fixed order (the pool the driver samples prompts from)."""
    out: list[Problem] = []
    if task == "count":
        for start in range(0, 7):
            for length in (2, 3, 4):
                end = start + length - 1
                if end > 9:
                    continue
                prompt = [BOS, "count", "from", str(start), "to", str(end), ":"]
                answer = [str(n) for n in range(start, end + 1)] + [EOS]
                out.append(Problem(_ids(prompt, vocab_size), _ids(answer, vocab_size)))
    elif task == "next":
        for n in range(9):
            prompt = [BOS, "Q", ":", "next", "number", "after", str(n), "?", "A", ":"]
            out.append(Problem(_ids(prompt, vocab_size), _ids([str(n + 1), EOS], vocab_size)))
    elif task == "guess":
        for secret in range(10):
            out.append(Problem(_ids(GUESS_PROMPT, vocab_size), _ids([str(secret), EOS], vocab_size)))
    else:
        raise ValueError(f"spec.task.name: unknown built-in task {task!r}; choose one of {list(TASKS)}")
    return out


def max_answer_tokens(task: str, *, vocab_size: int) -> int:
    return max(len(p.answer_ids) for p in problems(task, vocab_size=vocab_size))


def reward(generated: Sequence[int], answer: Sequence[int], *, kind: str) -> float:
    """Rule-based reward of one completion against the reference answer (which ends with <eos>)."""
    gen = list(generated)
    if kind == "exact-match":
        return 1.0 if gen[: len(answer)] == list(answer) else 0.0
    if kind == "prefix-match":
        matched = 0
        for got, want in zip(gen, answer, strict=False):
            if got != want:
                break
            matched += 1
        return matched / len(answer)
    raise ValueError(f"spec.task.reward: unknown reward {kind!r}; choose one of {list(REWARDS)}")


def sample_problems(pool: Sequence[Problem], *, count: int, rng: np.random.Generator) -> list[Problem]:
    """`count` problems drawn with replacement (the pool may be smaller than prompts_per_step)."""
    picks = rng.integers(0, len(pool), size=count)
    return [pool[int(i)] for i in picks]
