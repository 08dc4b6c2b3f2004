"""The row check both replay backends run when armed: every row that replays must be a real top-k set.

A row that replays hands its K ids to the MoE dispatch as they are. K copies of one expert (vLLM's
all-zero "no route" row, or any repeated id) would run one expert K times and skip the others, so on
an MoE layer such a row is refused; "no route" is said by the padding mask, whose rows route naturally.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


def unreplayable_rows(ids: torch.Tensor, no_route: torch.Tensor | None, *, num_experts: int) -> torch.Tensor:
    """[N] bool: rows of `ids` [N, K] that would replay wrongly (an id outside `[0, num_experts)` or a
    repeated id, all-zero rows included); rows flagged True in `no_route` [N] route naturally and pass.
    Runs on the ids' device without a host sync."""
    import torch

    bad = ((ids < 0) | (ids >= num_experts)).any(dim=-1)
    if ids.shape[1] > 1:
        ordered = ids.sort(dim=-1).values
        bad |= (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
    if no_route is not None:
        bad &= ~no_route.to(device=ids.device, dtype=torch.bool)
    return bad


def first_unreplayable(
    ids_per_layer: Mapping[int, torch.Tensor], no_route: torch.Tensor | None, *, num_experts: int
) -> str | None:
    """Why the first bad row of the first bad layer cannot be replayed ("MoE layer L: row R ..."), or None.

    One host sync for all layers together; the message is built only when something is wrong.
    """
    import torch

    bad = {layer: unreplayable_rows(ids, no_route, num_experts=num_experts) for layer, ids in ids_per_layer.items()}
    if not bad or not bool(torch.stack([rows.any() for rows in bad.values()]).any()):
        return None
    for layer, rows in bad.items():
        if bool(rows.any()):
            row = int(rows.nonzero()[0, 0])
            return f"MoE layer {layer}: {_why(ids_per_layer[layer][row].tolist(), row, num_experts)}"
    return None  # pragma: no cover - some layer had a bad row


def _why(values: list[int], row: int, num_experts: int) -> str:
    if any(v < 0 or v >= num_experts for v in values):
        return f"row {row} holds expert ids {values}, outside [0, {num_experts})"
    if not any(values):
        return (
            f"row {row} is all zero {values}: vLLM's 'no route' marker would replay expert 0 {len(values)} times; "
            "flag rows without a route in the padding mask (they route naturally)"
        )
    return f"row {row} repeats an expert id {values}: a top-k row must hold {len(values)} distinct experts"
