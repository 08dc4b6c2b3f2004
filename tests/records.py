"""A step's record for tests that read one figure or two (not a test module): what a test leaves out is a skipped
step's (runtime/step_record.py `StepRecord`'s defaults), its rollout figures zero."""

from __future__ import annotations

from typing import Any

from r3operator.runtime.step_record import StepRecord

_ROLLOUT = {
    "policy_version": 0,
    "replay_mode": "R3",
    "reward_mean": 0.0,
    "reward_std": 0.0,
    "samples": 0,
    "samples_dropped": 0,
    "tokens": 0,
    "tokens_per_second": 0.0,
}


def step_record(step: int, **figures: Any) -> StepRecord:
    return StepRecord(step=step, **{**_ROLLOUT, **figures})
