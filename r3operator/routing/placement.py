"""Where a sample's routes land in a right-padded batch: row r of routes that start at `start` is token column
`start + r`. Numpy only: the trainer's batch (trainer/batch.py) and the weight-sync canary both place routes so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3operator.routing.codec import RoutedExperts, decode


def place_routes(
    routes: Sequence[RoutedExperts], *, lengths: Sequence[int], width: int, sample_ids: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """([B, width, L, K] int64 ids, [B, width] bool no-route mask): row r of sample i at column start + r.

    Rows outside a sample's captured span stay zero and masked; "no route" is said by the mask only.
    """
    arrays = [decode(r, validate=False) for r in routes]
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"build_batch: samples' routes differ in (layers, top_k): {sorted(shapes)}")
    num_layers, top_k = shapes.pop()
    ids = np.zeros((len(arrays), width, num_layers, top_k), dtype=np.int64)
    no_route = np.ones((len(arrays), width), dtype=bool)
    for i, (r, rows, length) in enumerate(zip(routes, arrays, lengths, strict=True)):
        if r.end > length:
            raise ValueError(
                f"build_batch: routes of sample {sample_ids[i]!r} cover positions [{r.start}, {r.end}) "
                f"but the sample has {length} tokens"
            )
        ids[i, r.start : r.end] = rows
        no_route[i, r.start : r.end] = False
    return ids, no_route
