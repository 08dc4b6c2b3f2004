"""verl's reward, scored by r3operator's own code so that both frameworks score alike.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` for every response
(`reward.custom_reward_function.path` / `.name`); `solution_str` is the decoded response, special tokens
skipped, as r3operator decodes its completions. Per data source (benchmarks/peers/verl_inputs.py):

- `r3operator/arith` (the a3b comparison): r3operator's `math` reward;
- `r3operator/arith-chain` (the learning workload): r3operator's `function` reward with the learning benchmark's
  function (`benchmarks.learning.REWARD_FUNCTION`, `r3operator.tasks.arith_chain:score`), called through
  r3operator's `FunctionReward` with the four values its dataset task hands it: the row's prompt, the completion,
  the answer and the row's metadata (kept in the parquet's `extra_info`).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from r3operator.tasks.math_answer import answers_match
from r3operator.tasks.reward_base import RewardInput
from r3operator.tasks.rewards import FunctionReward

DATA_SOURCE = "r3operator/arith"
CHAIN_SOURCE = "r3operator/arith-chain"


@cache
def chain_reward() -> FunctionReward:
    from benchmarks.learning import REWARD_FUNCTION

    return FunctionReward(REWARD_FUNCTION)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    if data_source == DATA_SOURCE:
        return 1.0 if answers_match(solution_str, str(ground_truth)) else 0.0
    if data_source == CHAIN_SOURCE:
        info = extra_info if isinstance(extra_info, dict) else {}
        sample = RewardInput(
            sample_id=str(info.get("id", "")),
            prompt=str(info.get("prompt_text", "")),
            completion=solution_str,
            answer=str(ground_truth),
            metadata=json.loads(info.get("metadata_json") or "{}"),
        )
        return chain_reward().score([sample])[0]
    raise ValueError(
        f"verl_reward.compute_score: data_source {data_source!r} is neither {DATA_SOURCE!r} nor {CHAIN_SOURCE!r}"
    )
