"""The sample an engine hands back: prompt, generated tokens, their logprobs and routed experts.

It is what the rollout clients build, the tasks score, the trainer batches and the route recorder writes: it lives
with the routes it carries, below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from r3operator.routing.codec import RoutedExperts

ROUTES_MISSING = "engine returned no routed_experts (capture off on the server, or the request aborted)"


@dataclass(frozen=True, eq=False)
class RolloutSample:
    """One generated completion. `logprobs[i]` is the engine's logprob of `token_ids[i]` (float32)."""

    sample_id: str
    prompt_index: int
    choice_index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: np.ndarray
    routes: RoutedExperts | None
    routes_error: str | None = None
    finish_reason: str | None = None
    routed_experts_prompt_start: int = 0
    loss_mask: np.ndarray | None = None
    """bool per generated token: True = the model sampled it (trained). None: every generated token is the
    model's. A multi-turn trajectory sets False on the environment's tokens: they keep their routes (the
    context the model saw) but are no action of the policy."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sequence(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.token_ids

    @property
    def routes_status(self) -> Literal["ok", "missing", "invalid"]:
        """missing: the engine sent none (capture off / aborted); invalid: failed validation."""
        if self.routes is not None:
            return "ok"
        return "missing" if self.routes_error == ROUTES_MISSING else "invalid"
