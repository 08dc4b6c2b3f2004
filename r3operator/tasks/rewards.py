"""Rewards of a dataset task: each scores decoded completions against the rows' answers.

`spec.task.reward` picks one:

- `exact-match`: 1 when the completion equals the answer after whitespace is collapsed, else 0;
- `math`: 1 when the completion's final answer equals the answer's (`math_answer.answers_match`), else 0;
- `function`: `spec.task.rewardFunction`, a `module:function` importable in the trainer image, called once
  per sample as ``fn(prompt, completion, answer, metadata) -> float``;
- `http`: the step's samples POSTed as JSON to `spec.task.rewardURL` (`http_reward.py`).

Every reward sees the same four values per sample: `prompt` is the row's `prompt`, or for a `messages`
row the content of its last message; `completion` is the generated text (special tokens dropped);
`answer` is the row's `answer`; `metadata` holds the row's other columns and its `id`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from r3operator.api.enums import RewardKind
from r3operator.api.v1alpha1 import TaskSpec
from r3operator.tasks.http_reward import HTTPReward
from r3operator.tasks.math_answer import answers_match
from r3operator.tasks.reward_base import RewardError, RewardInput, checked_score

__all__ = [
    "ExactMatchReward",
    "FunctionReward",
    "HTTPReward",
    "MathReward",
    "RewardError",
    "RewardInput",
    "TextReward",
    "build_reward",
    "load_reward_function",
]

RewardFunction = Callable[[str, str, str, Mapping[str, Any]], float]


class TextReward(Protocol):
    def score(self, inputs: Sequence[RewardInput]) -> list[float]: ...


def _collapse(text: str) -> str:
    return " ".join(text.split())


class ExactMatchReward:
    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        return [float(_collapse(i.completion) == _collapse(i.answer)) for i in inputs]


class MathReward:
    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        return [float(answers_match(i.completion, i.answer)) for i in inputs]


def load_reward_function(reference: str) -> RewardFunction:
    """`module:function` → the callable; RewardError naming spec.task.rewardFunction when it is not there."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise RewardError(f"spec.task.rewardFunction {reference!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(
            f"spec.task.rewardFunction {reference!r}: cannot import {module_name!r} in the trainer ({exc}); "
            "install it into the trainer image or put it on PYTHONPATH"
        ) from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardError(f"spec.task.rewardFunction {reference!r}: {module_name} has no callable {attribute!r}")
    return function


class FunctionReward:
    def __init__(self, reference: str, function: RewardFunction | None = None) -> None:
        self.reference = reference
        self.function = function if function is not None else load_reward_function(reference)

    def score(self, inputs: Sequence[RewardInput]) -> list[float]:
        return [
            checked_score(
                self.function(i.prompt, i.completion, i.answer, i.metadata),
                what=f"reward function {self.reference} on sample {i.sample_id}",
            )
            for i in inputs
        ]


def build_reward(task: TaskSpec) -> TextReward:
    """The reward `task` declares (the rules in api/rules.py already refused a kind the task cannot use)."""
    if task.reward is RewardKind.EXACT_MATCH:
        return ExactMatchReward()
    if task.reward is RewardKind.MATH:
        return MathReward()
    if task.reward is RewardKind.FUNCTION:
        if task.reward_function is None:
            raise RewardError("spec.task.rewardFunction: task.reward function needs module:function")
        return FunctionReward(task.reward_function)
    if task.reward is RewardKind.HTTP:
        if task.reward_url is None:
            raise RewardError("spec.task.rewardURL: task.reward http needs the endpoint's URL")
        return HTTPReward(task.reward_url, timeout_s=task.reward_timeout_seconds)
    raise RewardError(
        f"spec.task.reward: {task.reward} compares token ids; a dataset task scores text with "
        "exact-match, math, function or http"
    )
