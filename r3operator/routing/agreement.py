"""Routing agreement: two routings of the same tokens compared as expert sets per (token, layer), numpy only.

The trainer's metrics, the weight-sync canary and the multi-turn rollout all measure it; it lives here, below
all three, so none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def as_array(x: Any, dtype: Any = None) -> np.ndarray:
    """`x` as a numpy array: a torch tensor (duck-typed, so torch stays optional here) is copied to the host."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    arr = np.asarray(x)
    return arr.astype(dtype, copy=False) if dtype is not None else arr


@dataclass(frozen=True)
class RoutingAgreement:
    token_layers: int
    agreement_ratio: float  # routed token-layers whose top-k id SETS are equal
    tokens_any_diff_ratio: float  # tokens with >= 1 routed layer that differs
    per_layer: tuple[float, ...]  # agreement per absolute layer; nan for a dense layer or no tokens


def _sorted_ids(x: Any) -> np.ndarray:
    arr = as_array(x)
    return np.sort(arr.astype(np.int64, copy=False), axis=-1)


def _compared_sets(trainer_ids: Any, engine_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """[..., L] bools: the two rows hold the same id set, and the engine's row is routed (not vLLM's zero row).

    Two torch tensors (duck-typed) off the host are compared where they are: a step's routes are [B, S, L, K] int64,
    hundreds of MB on the trainer's GPU, and only the [B, S, L] answer crosses to the host. Anything else is compared
    in numpy, whose sort of short rows beats torch's on a CPU (0.28 s against 0.53 s at the learning workload's size).
    """
    on_device = hasattr(engine_ids, "detach") and engine_ids.device.type != "cpu"
    if on_device and hasattr(trainer_ids, "detach"):
        return _compared_in_torch(trainer_ids, engine_ids)
    a, b = _sorted_ids(trainer_ids), _sorted_ids(engine_ids)
    _same_shape(a.shape, b.shape)
    return np.asarray((a == b).all(axis=-1)), np.asarray(b.any(axis=-1))


def _compared_in_torch(trainer_ids: Any, engine_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """`_compared_sets` of two torch tensors, computed on the engine ids' device."""
    _same_shape(tuple(trainer_ids.shape), tuple(engine_ids.shape))
    trainer = trainer_ids.detach().to(engine_ids.device)
    equal = (trainer.sort(dim=-1).values == engine_ids.detach().sort(dim=-1).values).all(dim=-1)
    return as_array(equal), as_array((engine_ids != 0).any(dim=-1))


def _same_shape(trainer: tuple[int, ...], engine: tuple[int, ...]) -> None:
    if trainer != engine or len(engine) < 2:
        raise ValueError(f"routing arrays must share shape [..., L, K]; got {trainer} and {engine}")


def routing_agreement(trainer_ids: Any, engine_ids: Any, mask: Any | None = None) -> RoutingAgreement:
    """Compare two [..., L, K] id arrays as sets per (token, layer); `mask` [...] selects tokens.

    A layer whose engine rows are all zero over the selected tokens is dense (vLLM reports dense layers
    that way): it has no routing to agree on, so it gets nan and stays out of the ratios, which would
    otherwise read 1.0 there whatever the routes.
    """
    equal_sets, routed_sets = _compared_sets(trainer_ids, engine_ids)
    num_layers = equal_sets.shape[-1]
    equal = equal_sets.reshape(-1, num_layers)  # [tokens, L]
    routed_rows = routed_sets.reshape(-1, num_layers)
    if mask is not None:
        sel = as_array(mask).astype(bool).reshape(-1)
        if sel.shape[0] != equal.shape[0]:
            raise ValueError(f"mask selects over {sel.shape[0]} tokens, routes have {equal.shape[0]}")
        equal, routed_rows = equal[sel], routed_rows[sel]
    routed = routed_rows.any(axis=0)  # [L]: MoE layers
    if equal.shape[0] == 0 or not routed.any():
        nan = float("nan")
        return RoutingAgreement(0, nan, nan, tuple([nan] * num_layers))
    moe = equal[:, routed]
    per_layer = np.full(num_layers, np.nan)
    per_layer[routed] = moe.mean(axis=0)
    return RoutingAgreement(
        token_layers=int(moe.size),
        agreement_ratio=float(moe.mean()),
        tokens_any_diff_ratio=float((~moe).any(axis=1).mean()),
        per_layer=tuple(float(v) for v in per_layer),
    )
