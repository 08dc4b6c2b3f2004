"""The post-sync weight canary: the engine's greedy decode must be the trainer's greedy decode.

The engine greedy-decodes fixed prompts; the trainer then teacher-forces each engine continuation through
ONE fp32 forward (no autocast, natural routing) and checks every generated position: the engine's token
must be the trainer's argmax. With the same prefix at every position this is exactly "engine greedy ==
trainer greedy" (including where each stops: an engine <eos> must be the trainer's argmax, and so must
every token the engine emitted instead of the trainer's <eos>), for the cost of one forward per prompt.

Two modes, chosen by the engine dtype (`canary_epsilon`):

- exact (ε = 0): an fp32 engine against the fp32 trainer forward (the CPU default). Any difference fails.
- near-tie (ε > 0): a bf16/fp16 engine (the GPU default). Its logits carry rounding error, so at a
  near-tie it may legitimately pick the trainer's runner-up. A position passes iff the engine token is the
  trainer's argmax, or `logit[argmax] - logit[engine token] <= ε` in the trainer's fp32 logits (so the
  trainer's top-2 margin there is below ε too). Teacher forcing keeps one accepted near-tie from
  cascading into "everything after it differs". Real corruption (a wrong MoE layout, a stale or
  sign-flipped tensor, a skipped chunk) moves logits by whole units, far above ε, and still fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Default ε (trainer fp32 logit units) for a bf16 engine. bf16 has an 8-bit mantissa: one rounding of a
# logit of magnitude |z| moves it by up to |z|·2^-9, and the forward accumulates many roundings (plus
# the occasional flipped expert near a router tie). Measured on the reference models (tiny, CPU; bf16
# vs fp32 forward of the same weights): max |Δlogit| 0.06-0.2 on canary prompts. 0.5 leaves headroom,
# and is still far below what a broken sync produces (top-1 margins of whole units, see tests).
BF16_CANARY_EPSILON = 0.5


def canary_epsilon(engine_dtype: str) -> float:
    """ε for the engine dtype; env R3_CANARY_EPSILON overrides (a user-set value, checked here)."""
    if raw := os.environ.get("R3_CANARY_EPSILON"):
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"R3_CANARY_EPSILON: expected a number >= 0, got {raw!r}") from None
        if value < 0 or value != value:
            raise ValueError(f"R3_CANARY_EPSILON: expected a number >= 0, got {raw!r}")
        return value
    return 0.0 if engine_dtype in ("float32", "fp32") else BF16_CANARY_EPSILON


class CanaryMismatchError(RuntimeError):
    """After a weight sync, the engine's greedy decode differs from the trainer's: the sync is broken."""


@dataclass
class CanaryResult:
    positions: int = 0
    near_ties: int = 0  # positions accepted only because of ε
    max_gap: float = 0.0  # largest logit[argmax] - logit[engine token] seen (0 when all equal)
    details: list[str] = field(default_factory=list)


def check_engine_greedy(
    logits_fn: Callable[[Sequence[int]], Any],
    prompts: Sequence[Sequence[int]],
    engine_outputs: Sequence[Sequence[int]],
    *,
    epsilon: float,
    eos_id: int,
    max_tokens: int,
    where: str = "engine 0",
) -> CanaryResult:
    """Raise `CanaryMismatchError` at the first position the engine's greedy token is not the trainer's.

    `logits_fn(sequence)` returns [len(sequence), V] fp32 next-token logits (trainer, natural routing).
    """
    result = CanaryResult()
    for i, (prompt, got) in enumerate(zip(prompts, engine_outputs, strict=True)):
        got = [int(t) for t in got]
        stopped_early = len(got) < max_tokens
        if stopped_early and (not got or got[-1] != eos_id):
            raise CanaryMismatchError(f"{where}, prompt {i} {list(prompt)}: engine stopped after {got} without <eos>")
        logits = logits_fn(list(prompt) + got)
        for j, token in enumerate(got):
            row = logits[len(prompt) - 1 + j]
            best = int(row.argmax())
            result.positions += 1
            if token == best:
                continue
            gap = float(row[best] - row[token])
            result.max_gap = max(result.max_gap, gap)
            if gap <= epsilon:
                result.near_ties += 1
                result.details.append(f"prompt {i} token {j}: engine {token} vs trainer {best}, gap {gap:.3g}")
                continue
            raise CanaryMismatchError(
                f"{where}, prompt {i} {list(prompt)}: first difference at generated token {j}: engine chose "
                f"{token}, trainer argmax {best} (logit gap {gap:.4g} > ε {epsilon:g}); engine output {got}"
            )
    return result
