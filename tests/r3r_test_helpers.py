"""Shared builders for the routing tests (not a test module)."""

from __future__ import annotations

import numpy as np


def make_routes(
    tokens: int, layers: int, top_k: int, num_experts: int, *, seed: int = 0, dtype: str = "int32"
) -> np.ndarray:
    """Random valid routes: ``top_k`` distinct ids in ``[0, num_experts)`` per (token, layer) row."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, num_experts, size=(tokens, layers, 1))
    ids = (base + np.arange(top_k)) % num_experts  # consecutive ids mod E: distinct when top_k <= E
    return rng.permuted(ids, axis=-1).astype(dtype)
