"""verl's reward for the arith dataset: r3operator's own `math` reward, so both frameworks score alike.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` for every response
(`reward.custom_reward_function.path` / `.name`); `solution_str` is the decoded response, special tokens
skipped, as r3operator's `math` reward decodes its completions.
"""

from __future__ import annotations

from typing import Any

from r3operator.tasks.math_answer import answers_match

DATA_SOURCE = "r3operator/arith"


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    if data_source != DATA_SOURCE:
        raise ValueError(f"verl_reward.compute_score: data_source {data_source!r} is not {DATA_SOURCE!r}")
    return 1.0 if answers_match(solution_str, str(ground_truth)) else 0.0
