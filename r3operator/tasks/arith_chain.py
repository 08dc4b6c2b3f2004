"""`arith-chain`: a generated long-answer task, sums of many numbers worked out one addition at a time.

A row asks for the sum of 2 to `max_terms` numbers from 1 to `max_value` and gives a worked solution that adds
them left to right, one addition a term, then the answer:

    prompt:   add 7 + 8 + 2 + 5
    solution: 7 + 8 = 15 , 15 + 2 = 17 , 17 + 5 = 22 . answer : 22
    answer:   22

Every word is in the reference tokenizer's vocabulary (`r3operator.models.tokenizer`), which reads a number
digit by digit, so with one-digit terms an addition is 8 to 10 tokens: 2 terms make ~10 tokens, 32 terms ~290.
The final answer is only right when every addition on the way is, which is what makes the task learnable
by RL from a warm start: a supervised warm-up teaches the format and most additions, and the reward (1 for the
right final answer, else 0) then rewards the chains with no slip.

The train and eval splits are disjoint by construction: a problem belongs to the eval split exactly when a hash
of its terms says so, so no seed or size of either split can put an eval prompt into training.

    r3operator tasks generate arith-chain DIR      # DIR/train.jsonl, DIR/eval.jsonl (deterministic bytes)

The reward is `score` below, named in an RLJob as `reward: function`, `rewardFunction:
r3operator.tasks.arith_chain:score`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

NAME = "arith-chain"
EVAL_ONE_IN = 16
"""A problem is in the eval split when the hash of its terms is 0 modulo this."""
_ANSWER = re.compile(r"answer\s*:\s*((?:\d\s*)+)\s*$")


@dataclass(frozen=True)
class ChainSpec:
    """The distribution a split is drawn from. Everything here is part of the files' identity."""

    min_terms: int = 2
    max_terms: int = 32
    max_value: int = 9
    train_rows: int = 20_000
    eval_rows: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"arith-chain: need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if self.max_value < 2:
            raise ValueError(f"arith-chain: max_value must be at least 2, got {self.max_value}")
        distinct = sum(self.max_value**n for n in range(self.min_terms, self.max_terms + 1))
        # Half the problems at most, so that drawing distinct ones of each split ends quickly.
        if 2 * (self.train_rows + self.eval_rows * EVAL_ONE_IN) > distinct:
            raise ValueError(
                f"arith-chain: {self.train_rows} train and {self.eval_rows} eval rows need more distinct problems than "
                f"{self.min_terms}-{self.max_terms} terms of 1-{self.max_value} make ({distinct}); raise max_terms"
            )


def solution(terms: Sequence[int]) -> str:
    """The worked solution: one `a + b = c` per term after the first, then `answer : total`."""
    steps = []
    total = terms[0]
    for term in terms[1:]:
        steps.append(f"{total} + {term} = {total + term}")
        total += term
    return " , ".join(steps) + f" . answer : {total}"


def prompt(terms: Sequence[int]) -> str:
    return "add " + " + ".join(str(t) for t in terms)


def in_eval_split(terms: Sequence[int]) -> bool:
    digest = hashlib.sha256(",".join(str(t) for t in terms).encode()).digest()
    return int.from_bytes(digest[:8], "little") % EVAL_ONE_IN == 0


def _problems(spec: ChainSpec, *, eval_split: bool) -> Iterator[list[int]]:
    """Distinct problems of one split, in a seeded order (the eval split draws from its own stream)."""
    rng = np.random.default_rng([spec.seed, 1 if eval_split else 0])
    seen: set[tuple[int, ...]] = set()
    while True:
        n = int(rng.integers(spec.min_terms, spec.max_terms + 1))
        terms = [int(x) for x in rng.integers(1, spec.max_value + 1, size=n)]
        key = tuple(terms)
        if key in seen or in_eval_split(terms) != eval_split:
            continue
        seen.add(key)
        yield terms


def rows(spec: ChainSpec, *, split: str) -> list[dict[str, Any]]:
    """The rows of `split` ("train" or "eval"): `id`, `prompt`, `answer`, `solution`, `terms`."""
    if split not in ("train", "eval"):
        raise ValueError(f"arith-chain: split must be train or eval, got {split!r}")
    count = spec.train_rows if split == "train" else spec.eval_rows
    out = []
    for n, terms in zip(range(count), _problems(spec, eval_split=split == "eval"), strict=False):
        out.append(
            {
                "id": f"{split}-{n}",
                "prompt": prompt(terms),
                "answer": str(sum(terms)),
                "solution": solution(terms),
                "terms": len(terms),
            }
        )
    return out


def write_splits(directory: Path, spec: ChainSpec | None = None) -> dict[str, Path]:
    """DIR/train.jsonl and DIR/eval.jsonl (each written to a temporary name and renamed: never half there)."""
    spec = spec or ChainSpec()
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "eval"):
        path = directory / f"{split}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows(spec, split=split)))
        tmp.replace(path)
        paths[split] = path
    return paths


def final_answer(completion: str) -> str | None:
    """The digits after the last `answer :` at the end of the completion, spaces removed (the reference tokenizer
    decodes `102` as `1 0 2`); None when the completion does not end with an answer."""
    found = _ANSWER.search(completion.strip())
    return None if found is None else "".join(found.group(1).split())


def score(prompt: str, completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion ends with the right final answer, else 0.0 (the steps are not graded)."""
    del prompt, metadata  # the reward function's signature (tasks/rewards.py); the answer alone decides
    got = final_answer(completion)
    return 1.0 if got is not None and got == "".join(answer.split()) else 0.0
