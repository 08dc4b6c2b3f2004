"""Micro-batches by token budget (`trainer.fsdp.microBatchTokens`): one forward (and backward) at a time.

A step's mini-batch can be far larger than one forward fits: 128 samples of 500 tokens are 64k tokens, and the
MoE's activations for them tens of GiB. The rows of a mini-batch are grouped by length into micro-batches
whose padded size (rows × the longest row) stays within the budget, each is trimmed to its own longest row,
and their gradients add up to the mini-batch's before its one optimizer step, as verl's dynamic batch size
does (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`). Grouping by length also removes most padding: a
mini-batch padded to its longest row spends half its compute on pad tokens when lengths vary 2×.

The loss stays the mini-batch's token-mean: each micro-batch's token-mean is weighted by its share of the
mini-batch's loss tokens (`micro_weights`), so the summed gradient equals the single forward's up to
summation order.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(lengths: Sequence[int], *, budget: int | None) -> list[list[int]]:
    """Positions 0..len(lengths)-1 grouped into micro-batches whose `rows × longest length` is at most `budget`
    (a row longer than the budget goes alone). Longest rows first, so each group's rows have similar
    lengths; within a group, positions keep ascending order. `budget` None: one group of every position."""
    if not lengths:
        return []
    if budget is None:
        return [list(range(len(lengths)))]
    if budget < 1:
        raise ValueError(f"trainer.fsdp.microBatchTokens must be at least 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        length = max(int(lengths[i]), 1)
        if current and (len(current) + 1) * max(longest, length) > budget:
            groups.append(sorted(current))
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    groups.append(sorted(current))
    return groups


def micro_weights(tokens: Sequence[int], groups: Sequence[Sequence[int]]) -> list[float]:
    """Each group's share of the loss tokens (`tokens[i]` is position i's count): the weight that turns the
    group's token-mean into its part of the whole's token-mean. A whole without loss tokens weighs nothing."""
    total = sum(int(t) for t in tokens)
    if total == 0:
        return [0.0 for _ in groups]
    return [sum(int(tokens[i]) for i in group) / total for group in groups]
