"""Multi-turn environments, token ids in and token ids out.

An environment answers each model turn of one conversation: `turn(conversation, generated)` gets every
token id of the conversation so far (the model's latest turn last) and that latest turn, and returns the
tokens it appends (its observation), whether the conversation is over, and the reward when it is. The
environment works on token ids only: its reply is appended as ids, so the conversation is never
re-tokenised and the engine's routes stay on the tokens they were computed for (the `R3-RETOKENIZE` rule).

Built-in: `guess`, a guessing game over the reference vocabulary. The problem holds a secret digit; each
turn the model names a digit, the environment answers `<` (the secret is smaller), `>` (larger) or ends
the game. A model that reads the hints finds any digit in 4 guesses.

    <bos> Q : what number from 0 to 9 ? A :   4 <eos>   > A :   7 <eos>   < A :   6 <eos>
    └──────────── prompt ─────────────────┘ └model┘ └env─┘ └model┘ └env─┘ └model┘  reward 1 - 2/4
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from r3operator.models.tokenizer import vocabulary
from r3operator.tasks.toy import Problem


@dataclass(frozen=True)
class EnvReply:
    tokens: tuple[int, ...]  # appended to the conversation; empty when the conversation is over
    done: bool
    reward: float  # the trajectory's reward; only read when done


class Environment(Protocol):
    """One conversation's environment (stateful: it counts the turns it has answered)."""

    max_turns: int  # the driver ends the conversation after this many model turns

    def turn(self, conversation: Sequence[int], generated: Sequence[int]) -> EnvReply: ...


class GuessGame:
    """Find the secret digit; reward `1 - wrong_guesses / max_turns` on a hit, 0 when the turns run out."""

    def __init__(self, secret: int, *, vocab_size: int, max_turns: int = 4) -> None:
        if not 0 <= secret <= 9:
            raise ValueError(f"guess: the secret must be a digit, got {secret}")
        if max_turns < 1:
            raise ValueError(f"guess: max_turns must be at least 1, got {max_turns}")
        index = {tok: i for i, tok in enumerate(vocabulary(vocab_size))}
        self.secret = secret
        self.max_turns = max_turns
        self.turns = 0
        self._digit = {index[str(d)]: d for d in range(10)}
        self._smaller, self._larger, self._answer = index["<"], index[">"], (index["A"], index[":"])
        self._no = index["no"]

    def guess_of(self, generated: Sequence[int]) -> int | None:
        """The first digit the model wrote in its turn (None: no digit, not a guess)."""
        return next((self._digit[t] for t in generated if t in self._digit), None)

    def turn(self, conversation: Sequence[int], generated: Sequence[int]) -> EnvReply:
        self.turns += 1
        guess = self.guess_of(generated)
        if guess == self.secret:
            return EnvReply((), done=True, reward=1.0 - (self.turns - 1) / self.max_turns)
        if self.turns >= self.max_turns:
            return EnvReply((), done=True, reward=0.0)
        hint = self._no if guess is None else self._smaller if self.secret < guess else self._larger
        return EnvReply((hint, *self._answer), done=False, reward=0.0)


ENVIRONMENTS: dict[str, Callable[[Problem, int], Environment]] = {
    # The problem's answer is "<secret> <eos>" (tasks.problems("guess")).
    "guess": lambda problem, vocab_size: GuessGame(
        int(vocabulary(vocab_size)[problem.answer_ids[0]]), vocab_size=vocab_size
    ),
}


def environment(task: str, problem: Problem, *, vocab_size: int) -> Environment:
    """A fresh environment for one conversation of `problem` (multi-turn tasks only)."""
    if task not in ENVIRONMENTS:
        raise ValueError(
            f"spec.task.name: {task!r} has no multi-turn environment; spec.rollout.multiTurn needs one of "
            f"{sorted(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[task](problem, vocab_size)
