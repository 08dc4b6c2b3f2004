"""What every reward of a dataset task shares: its input per sample, its error, and the check of a score."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class RewardError(ValueError):
    """A reward could not be computed: the function is missing or returned no number, the endpoint refused."""


@dataclass(frozen=True)
class RewardInput:
    sample_id: str
    prompt: str
    completion: str
    answer: str
    metadata: Mapping[str, Any]


def checked_score(value: Any, *, what: str) -> float:
    """A reward must be a finite real number (a bool counts as 0/1)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError(f"{what} returned {value!r}; a reward is a finite number")
    return float(value)
