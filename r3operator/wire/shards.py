"""Which part of a whole kernel-layout parameter one engine rank holds: the kernel layout on sharded engines.

A tensor-parallel engine rank holds a slice of each sharded parameter (rows of a column-parallel weight, columns of a
row-parallel one); a fused one holds a slice of each part (q, k and v of `qkv_proj`, gate and up of `gate_up_proj` and
of every expert's w13, its head group of k and v); an expert-parallel rank holds some experts whole. So a `Shard` says,
per dimension of the WHOLE parameter (what the trainer builds: wire/kernel_layout.py), which of its indices the rank
holds, in the rank's order: runs of (start, length), or None for the whole dimension. The engine derives it from
vLLM's own layers (engine/shards.py) and reports it beside the whole shape; the trainer plans and sends whole
parameters, as for an engine of one rank; each rank takes its part of what it received (`take`), and the first sync of
a plan checks that part, rank by rank, against what vLLM's own `load_weights` put there (weightsync/transfer.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Any: wire/ loads no framework at import: the tensors `take` reads are Any here.

Run = tuple[int, int]
"""(start, length): consecutive indices of one dimension of the whole parameter."""


class ShardError(ValueError):
    """A shard that cannot be right (the message names the parameter)."""


@dataclass(frozen=True)
class Shard:
    """The part of a whole parameter of shape `whole` one rank holds: per dimension, its runs (None: all of it)."""

    whole: tuple[int, ...]
    runs: tuple[tuple[Run, ...] | None, ...]

    def __post_init__(self) -> None:
        if len(self.runs) != len(self.whole):
            raise ShardError(f"a shard of a {len(self.whole)}-d parameter names {len(self.runs)} dimensions")
        for size, runs in zip(self.whole, self.runs, strict=True):
            for start, length in runs or ():
                if start < 0 or length <= 0 or start + length > size:
                    raise ShardError(f"run ({start}, {length}) is outside a dimension of {size}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The rank's part's shape: what its parameter must be."""
        return tuple(
            size if runs is None else sum(length for _, length in runs)
            for size, runs in zip(self.whole, self.runs, strict=True)
        )

    def to_wire(self) -> dict[str, Any]:
        return {"whole": list(self.whole), "runs": [None if r is None else [list(run) for run in r] for r in self.runs]}

    @classmethod
    def from_wire(cls, value: Mapping[str, Any], *, name: str) -> Shard:
        """A shard as `to_wire` wrote it; anything else is refused naming `name`."""
        try:
            whole = tuple(int(size) for size in value["whole"])
            runs = tuple(
                None if r is None else tuple((int(start), int(length)) for start, length in r) for r in value["runs"]
            )
            return cls(whole, runs)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{name}: not a shard ({exc}): {value!r}") from None


def shard_of(whole: Sequence[int], runs: Mapping[int, Sequence[Run]]) -> Shard | None:
    """The shard holding `runs` of the dimensions they name and the rest whole; None when that is the whole
    parameter (an engine of one rank, a replicated parameter)."""
    per_dim = tuple(_merged(runs[d]) if d in runs else None for d in range(len(whole)))
    merged = tuple(None if r == ((0, whole[d]),) else r for d, r in enumerate(per_dim))
    if all(r is None for r in merged):
        return None
    return Shard(tuple(whole), merged)


def _merged(runs: Sequence[Run]) -> tuple[Run, ...]:
    """Adjacent runs as one (an expert-parallel rank's consecutive experts: one run, not one per expert)."""
    out: list[Run] = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)


def take(tensor: Any, shard: Shard) -> Any:
    """The rank's part of the whole `tensor` (a new tensor, on its device)."""
    import torch

    if tuple(tensor.shape) != shard.whole:
        raise ShardError(f"a shard of {list(shard.whole)} taken from a tensor of {list(tensor.shape)}")
    part = tensor
    for dim, runs in enumerate(shard.runs):
        if runs is None:
            continue
        index = torch.cat([torch.arange(start, start + length, device=tensor.device) for start, length in runs])
        part = part.index_select(dim, index)
    return part
