"""The row check both replay backends run when armed: every row that replays must be a real top-k set.

A row that replays hands its K ids to the MoE dispatch as they are. K copies of one expert (vLLM's
all-zero "no route" row, or any repeated id) would run one expert K times and skip the others, so on
an MoE layer such a row is refused; "no route" is said by the padding mask, whose rows route naturally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


def replay_row_problem(ids: torch.Tensor, no_route: torch.Tensor | None, *, num_experts: int) -> str | None:
    """Why some row of `ids` [N, K] cannot be replayed (naming the row), or None; rows flagged True in
    `no_route` [N] route naturally and are not checked."""
    import torch

    replays = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    if no_route is not None:
        replays &= ~no_route.to(device=ids.device, dtype=torch.bool)
    outside = ((ids < 0) | (ids >= num_experts)).any(dim=-1) & replays
    if bool(outside.any()):
        row = int(outside.nonzero()[0, 0])
        return f"row {row} holds expert ids {ids[row].tolist()}, outside [0, {num_experts})"
    if ids.shape[1] < 2:
        return None
    ordered = ids.sort(dim=-1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1) & replays
    if not bool(repeated.any()):
        return None
    row = int(repeated.nonzero()[0, 0])
    values = ids[row].tolist()
    if not any(values):
        return (
            f"row {row} is all zero {values}: vLLM's 'no route' marker would replay expert 0 {len(values)} times; "
            "flag rows without a route in the padding mask (they route naturally)"
        )
    return f"row {row} repeats an expert id {values}: a top-k row must hold {len(values)} distinct experts"
